"""ShutdownHandler and DistributedSignalHandler with real signals in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from steadfast import ConfigError, DistributedSignalHandler, ShutdownHandler


def _deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_and_finish_restores(sig, event_log: Path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    h = ShutdownHandler(timeout_sec=30)
    h.register()
    assert not h.should_shutdown() and h.signal_received is None
    _deliver(sig)
    assert h.should_shutdown() and h.shutdown_requested and h.signal_received == sig
    timers = [t for t in threading.enumerate() if t.name == "steadfast-forced-exit"]
    assert len(timers) == 1
    _deliver(sig)  # a second signal does not start a second timer
    assert len([t for t in threading.enumerate() if t.name == "steadfast-forced-exit"]) == 1
    h.finish()
    assert not any(t.name == "steadfast-forced-exit" for t in threading.enumerate())
    assert {s: signal.getsignal(s) for s in before} == before
    kinds = [json.loads(x) for x in event_log.read_text().splitlines()]
    assert [k["kind"] for k in kinds] == ["shutdown_requested", "shutdown_complete"]
    assert kinds[0]["cause"] == sig.name and kinds[0]["signal"] == int(sig)


def test_wakeup_fd_is_chained_and_restored():
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    try:
        h = ShutdownHandler(timeout_sec=0)
        h.register()
        assert any(t.name == "steadfast-signal-watcher" for t in threading.enumerate())
        _deliver(signal.SIGUSR1)
        time.sleep(0.05)
        assert os.read(r, 16) == bytes([signal.SIGUSR1])  # forwarded to the earlier fd
        h.unregister()
        assert signal.set_wakeup_fd(w) == w  # the earlier fd is back in place
        assert not any(t.name == "steadfast-signal-watcher" for t in threading.enumerate())
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)


def test_timeout_zero_starts_no_timer():
    h = ShutdownHandler(timeout_sec=0)
    h.register()
    try:
        _deliver(signal.SIGTERM)
        assert h.should_shutdown()
        assert not any(t.name == "steadfast-forced-exit" for t in threading.enumerate())
    finally:
        h.unregister()


def test_defaults_and_bad_timeout():
    assert ShutdownHandler().timeout_sec == 600.0
    with pytest.raises(ConfigError, match=r"ShutdownHandler\.timeout_sec: must be >= 0"):
        ShutdownHandler(timeout_sec=-1)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="must be a finite number"):
            ShutdownHandler(timeout_sec=bad)


def test_register_outside_main_thread_is_a_clear_error():
    errors: list[BaseException] = []

    def body() -> None:
        try:
            ShutdownHandler().register()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "must be called from the main thread" in str(errors[0])


def test_register_twice_then_unregister_restores_the_original():
    before = signal.getsignal(signal.SIGTERM)
    h = ShutdownHandler()
    h.register()
    h.register()
    h.unregister()
    assert signal.getsignal(signal.SIGTERM) == before


_STUCK = """
import time
from steadfast import ShutdownHandler
h = ShutdownHandler(timeout_sec=0.5)
h.register()
print("ready", flush=True)
while True:          # a training loop stuck in a collective: never checks the flag
    time.sleep(0.05)
"""


def test_forced_exit_ends_a_stuck_process_with_code_1(event_log: Path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _, err = proc.communicate()
    assert code == 1
    assert "forcing exit (code 1)" in err
    # the stuck main thread's stack was dumped before the exit: line 8 is the sleep
    assert 'File "<string>", line 8 in <module>' in err
    kinds = [json.loads(x)["kind"] for x in event_log.read_text().splitlines()]
    assert kinds == ["shutdown_requested", "shutdown_forced"]


def test_distributed_signal_handler_single_process(event_log: Path):
    before = signal.getsignal(signal.SIGTERM)
    with DistributedSignalHandler() as h:
        assert h.installed and h.signals_received() == [False]
        _deliver(signal.SIGTERM)
        assert h.signals_received() == [True] and h.signal_received
    assert signal.getsignal(signal.SIGTERM) == before
    assert h.release() is False  # idempotent
    with DistributedSignalHandler(signal.SIGUSR1) as h2:
        assert h2.signals_received() == [False]
    assert json.loads(event_log.read_text())["cause"] == "SIGTERM"


def test_distributed_signal_handler_outside_main_thread_installs_nothing():
    out: list[object] = []

    def body() -> None:
        with DistributedSignalHandler() as h:
            out.append((h.installed, h.signals_received()))
        out.append(h.released)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert out == [(False, [False]), True]
