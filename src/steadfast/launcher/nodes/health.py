"""The node health check: whether this node is fit to join a rendezvous (its checkpoint
directory writable with room to spare, its GPUs, the user's own command). The agent
runs it before each rendezvous; a node that fails it leaves the job (``node_unhealthy``)
and a spare may take its place.

The GPU check runs in a child process, so that the launcher holds no CUDA context. A
new Python that imports torch took 3.9 s of each restart on a lent H200 (the whole check
there), so the next check's child is started ahead (:class:`GpuCheck`): once this check
passed it imports torch at the lowest CPU priority and waits on its stdin; a restart
asks it, once it said it is ready, and pays for CUDA's start and the check alone (one
still importing is replaced by a new one, at the usual priority).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Collection, Iterator

from ... import events
from ...config import FaultToleranceConfig
from .trust import Check, check_mounts, check_network, gpu_memory_freed, job_interface

__all__ = ["GpuCheck", "health_check"]

logger = logging.getLogger(__name__)

#: What the warm check reads on its stdin to run (anything else, or EOF: it ends).
ASK = "check\n"


class GpuCheck:
    """The GPU part of the health check, with the next one's process started ahead:
    :meth:`run` asks the warm child (or runs a cold one), then :meth:`warm` starts the
    next; :meth:`close` ends a child still waiting (it also ends by itself when the
    launcher goes: EOF on its stdin)."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self._next: subprocess.Popen[str] | None = None

    def _argv(self, warm: bool) -> list[str]:
        argv = [sys.executable, "-m", "steadfast.cli", "health", "--all-devices", str(self.gpus)]
        return [*argv, "--when-asked"] if warm else argv

    def warm(self) -> None:
        """Start the next check's child: it imports torch (niced) and waits to be asked."""
        if self.gpus <= 0 or self._next is not None:
            return
        with contextlib.suppress(OSError):  # then the next check starts cold
            self._next = subprocess.Popen(
                self._argv(warm=True),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )

    def run(self, timeout: float) -> str | None:
        """None when every GPU is healthy; else why. The warm child when there is one."""
        proc, self._next = self._next, None
        if proc is None or proc.poll() is not None or not _ready(proc):
            if proc is not None:  # gone, or still importing (at nice 19): a new one
                _end(proc)
            return _run(self._argv(warm=False), timeout)
        try:
            out, _ = proc.communicate(ASK, timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            return f"the GPU check did not finish in {timeout:g} s"
        except OSError:  # it died meanwhile: once more, cold
            _end(proc)
            return _run(self._argv(warm=False), timeout)
        return None if proc.returncode == 0 else _why(proc.returncode, out)

    def close(self) -> None:
        proc, self._next = self._next, None
        if proc is not None:
            _end(proc)


def _ready(proc: subprocess.Popen[str]) -> bool:
    """Whether the warm child finished its imports (its first line, ``ready``)."""
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], 0)[0]:
        return False
    return proc.stdout.readline() == "ready\n"


def _end(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.communicate(timeout=10)


def health_check(
    ft: FaultToleranceConfig,
    gpus: GpuCheck,
    rendezvous_host: str | None = None,
    previous_pids: Collection[int] = (),
) -> tuple[str, str] | None:
    """This node's health before it joins a rendezvous: ``(check, reason)`` for the
    first check that failed, None when healthy. In order: the node ledger (``ledger``:
    a node with ``node_ledger_max_faults`` faults there is not trusted; an unreadable
    ledger is said and does not keep the node out); ``node_health_check_dir``
    writable with ``node_min_free_gb`` free; each of ``gpus`` GPUs
    (:func:`~steadfast.health.check_gpu_health`, in a child process so that the launcher
    holds no CUDA context); the storage, the network interface the job uses (its route
    to ``rendezvous_host``) and, before a restart, the GPU memory of the previous workers
    (``previous_pids``) freed (:mod:`.trust`, each a ``node_check`` event); the user's
    ``node_health_check`` command."""
    if ft.node_ledger and ft.node_ledger_max_faults:
        from ...ledger import LedgerError, refusal

        try:
            why = refusal(ft.node_ledger, ft.node_ledger_max_faults, ft.node_ledger_window_days)
        except LedgerError as exc:
            logger.warning("node health check: cannot read the node ledger: %s", exc)
            why = None
        if why is not None:
            return "ledger", why
    directory = ft.node_health_check_dir
    if directory is not None:
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".steadfast-health-") as f:
                f.write(b"x")
                f.flush()
                os.fsync(f.fileno())
            free = shutil.disk_usage(directory).free / 2**30
        except OSError as exc:
            return "checkpoint_dir", f"{directory} is not writable: {exc}"
        if free < ft.node_min_free_gb:
            return (
                "checkpoint_dir",
                f"{directory} has {free:.2f} GiB free, below node_min_free_gb="
                f"{ft.node_min_free_gb:g}",
            )
    for check in _trust_checks(ft, gpus, rendezvous_host, previous_pids):
        if check.skipped is not None:
            logger.debug("node check %s skipped: %s", check.name, check.skipped)
            continue
        events.emit(
            "node_check", cause=check.name, figure=check.figure, unit=check.unit,
            passed=check.failed is None, reason=check.failed, skipped=check.skipped,
        )  # fmt: skip
        if check.failed is not None:
            return check.name, check.failed
    if gpus.gpus > 0:
        done = gpus.run(300)
        if done is not None:
            return "gpu", done
        gpus.warm()  # for the next check
    if ft.node_health_check:
        done = _run(["sh", "-c", ft.node_health_check], 300)
        if done is not None:
            return "command", done
    return None


def _trust_checks(
    ft: FaultToleranceConfig,
    gpus: GpuCheck,
    rendezvous_host: str | None,
    previous_pids: Collection[int],
) -> Iterator[Check]:
    """The checks of :mod:`.trust` the settings ask for, one at a time (the first that
    fails ends the health check)."""
    if ft.node_check_mounts:
        paths = [p.strip() for p in ft.node_check_mounts.split(",") if p.strip()]
        yield check_mounts(paths, ft.node_check_write_timeout)
    if ft.node_check_network:
        yield check_network(job_interface(rendezvous_host), ft.node_min_link_gbps)
    if gpus.gpus > 0 and previous_pids and ft.node_gpu_memory_free_timeout > 0:
        yield gpu_memory_freed(previous_pids, ft.node_gpu_memory_free_timeout)


def _run(argv: list[str], timeout: float) -> str | None:
    """None when ``argv`` exits 0; else why, with the last line of its output."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"{argv[-1]!r} did not finish in {timeout:g} s"
    except OSError as exc:
        return f"cannot run {argv[0]}: {exc}"
    return None if done.returncode == 0 else _why(done.returncode, done.stdout + done.stderr)


def _why(code: int, out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    tail = lines[-1].strip() if lines else "no output"
    return f"exit {code}: {tail}"
