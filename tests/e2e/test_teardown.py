"""A finished script's teardown (issues 50 and 68): a worker whose training is over (its
``destroy_process_group()`` returned, or its script finished) and then hangs or dies
ends the job with exit 0, within ``teardown_timeout``, and the training runs once; the
event log says what happened (``worker_teardown``, with the stack of a rank whose Python
cannot say) and the report shows a warning, not a fault. The same fault before the
training was over is a fault, and is restarted; a rank that hangs once every other rank
has finished is torn down, not restarted."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfharness import launch_run

HERE = Path(__file__).parent
SCRIPT = HERE / "teardown_train.py"
TEARDOWN = 3.0

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_worker_outlives_its_launcher")]


def run(tmp_path: Path, mode: str, *flags: str) -> tuple[int, list, list[str], float]:
    trace = tmp_path / "trace"
    began = time.monotonic()
    code, evs = launch_run(
        tmp_path, "--nproc-per-node=2", "--max-restarts=2",
        f"--ft-teardown-timeout={TEARDOWN}", *flags, str(SCRIPT), mode, str(trace),
    )  # fmt: skip
    took = time.monotonic() - began
    return code, evs, trace.read_text().split("\n")[:-1], took


def teardowns(evs: list, faulted: int | None) -> dict[int, dict]:
    """The ``worker_teardown`` events by worker pid; ``faulted``: the pid of the worker the
    test made fail, whose event the test checks itself.

    The script ends with DDP alive at ``destroy_process_group()``, as a user's does, and
    there torch's own teardown sometimes aborts ("terminate called without an active
    exception", docs/troubleshooting.md), on any rank, under torchrun too. The launcher
    reports that as it should, a warning and not a fault: it is allowed on the other
    workers, as exactly that (cause ``signal``, SIGABRT) and nothing else."""
    out = {e["worker_pid"]: e for e in evs if e["kind"] == "worker_teardown"}
    for pid, e in out.items():
        if pid != faulted:
            assert (e["cause"], e.get("signal")) == ("signal", "SIGABRT"), e
    return out


def _pid(evs: list, rank: int) -> int:
    """The pid of ``rank``'s first worker."""
    started = next(e for e in evs if e["kind"] == "workers_started")
    return int(started["pids"][rank])


def report(tmp_path: Path) -> str:
    return subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "report", "--no-timeline", str(tmp_path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


@pytest.mark.parametrize("template", ["true", "false"])
def test_a_finished_worker_hung_in_atexit_is_ended_and_the_training_runs_once(
    tmp_path: Path, template: str
):
    """Forked from the template, or started as a plain process with the progress hooks'
    boot: the same."""
    code, evs, trained, took = run(tmp_path, "atexit-hang", f"--ft-worker-template={template}")
    assert code == 0
    assert sorted(trained) == ["trained 0", "trained 1"]  # once: no restart
    assert [e["kind"] for e in evs].count("workers_started") == 1
    teardown = teardowns(evs, _pid(evs, 1))[_pid(evs, 1)]
    assert (teardown["rank"], teardown["cause"]) == (1, "hung")
    assert teardown["after"] >= TEARDOWN
    assert not [e for e in evs if e["kind"] in ("rank_failed", "rank_hung", "hang_confirmed")]
    assert took < 60
    text = report(tmp_path)
    assert "warning: rank 1 had not exited after" in text
    assert "faults: none injected, none seen" in text


def test_a_finished_worker_that_aborts_in_teardown_is_finished(tmp_path: Path):
    code, evs, trained, _ = run(tmp_path, "abort-after")
    assert code == 0
    assert sorted(trained) == ["trained 0", "trained 1"]
    teardown = teardowns(evs, _pid(evs, 1))[_pid(evs, 1)]
    assert (teardown["rank"], teardown["cause"], teardown["signal"]) == (1, "signal", "SIGABRT")
    assert not [e for e in evs if e["kind"] in ("rank_failed", "restart")]
    assert "warning: rank 1 died of SIGABRT in its teardown" in report(tmp_path)


def test_an_abort_before_the_script_finished_is_still_a_fault(tmp_path: Path):
    code, evs, trained, _ = run(tmp_path, "abort-before")
    assert code == 0
    [failed] = [e for e in evs if e["kind"] == "rank_failed"]
    assert (failed["rank"], failed["signal"]) == (1, "SIGABRT")
    assert [e["kind"] for e in evs].count("restart") == 1
    assert sorted(trained) == ["trained 0", "trained 0", "trained 1", "trained 1"]
    assert _pid(evs, 1) not in teardowns(evs, None)  # the abort before the end: a fault


def test_a_rank_holding_the_gil_after_destroying_its_group_is_torn_down_with_its_native_stack(
    tmp_path: Path,
):
    """The tutorial's deadlock, as the launcher meets it: after its
    ``destroy_process_group()`` returned, rank 1's main thread keeps the GIL in C."""
    code, evs, trained, _ = run(tmp_path, "gil-after-destroy")
    assert code == 0
    assert sorted(trained) == ["trained 0", "trained 1"]
    assert [e["kind"] for e in evs].count("workers_started") == 1
    teardown = teardowns(evs, _pid(evs, 1))[_pid(evs, 1)]
    assert (teardown["rank"], teardown["cause"], teardown["state"]) == (1, "hung", "tearing_down")
    assert teardown["after"] >= TEARDOWN
    native = "\n".join(teardown["native"])
    assert "sleep" in native and "teardown_train.py" in native, native  # C and Python frames
    assert not [e for e in evs if e["kind"] in ("rank_failed", "rank_hung", "restart")]


def test_a_rank_working_after_destroying_its_group_is_left_to_finish(tmp_path: Path):
    """Rank 0 computes past ``teardown_timeout`` after its destroy (a final save's work):
    it moves, so it is looked at again, not torn down, and ends on its own."""
    code, evs, trained, _ = run(tmp_path, "save-after-destroy")
    assert code == 0
    assert sorted(trained) == ["trained 0", "trained 1"]
    assert _pid(evs, 0) not in teardowns(evs, None)
    [exited] = [e for e in evs if e["kind"] == "workers_exited"]
    assert exited["cause"] == "succeeded"
    assert [x["exit_code"] for x in exited["exits"]] == [0, 0]


def test_a_rank_that_hangs_once_every_other_rank_finished_is_torn_down_not_restarted(
    tmp_path: Path,
):
    """Rank 1 keeps the GIL after its training loop, before its destroy; rank 0 destroys
    its group and ends. The hang is confirmed after the job's last collective: a restart
    would train the finished job again."""
    code, evs, trained, _ = run(tmp_path, "gil-peers-done")
    assert code == 0
    assert sorted(trained) == ["trained 0", "trained 1"]
    assert [e["kind"] for e in evs].count("workers_started") == 1
    teardown = teardowns(evs, _pid(evs, 1))[_pid(evs, 1)]
    assert (teardown["rank"], teardown["cause"]) == (1, "hung")
    assert "sleep" in "\n".join(teardown["native"])
    assert not [e for e in evs if e["kind"] in ("rank_failed", "rank_hung", "restart")]
