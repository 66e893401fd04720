"""`steadfast launch` end to end: 2 gloo ranks, real faults, real restarts.

Each fault test checks three things: the fault was detected (an event with its cause),
the run recovered (exit 0 after an in-job restart), and the final parameters equal the
fault-free run's bit for bit. The conftest leak check also fails a test that leaves a
process or the /dev/shm heartbeat table behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from steadfast import FaultToleranceConfig

SCRIPT = Path(__file__).with_name("ft_train.py")
TIMEOUTS = [
    "--ft-param-rank_section_timeouts=setup:60,step:2,checkpointing:5",
    "--ft-rank_out_of_section_timeout",
    "3",
    "--ft-param-workers_stop_timeout=5",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("no_worker_outlives_its_launcher"),
]


def _launch(
    workdir: Path,
    *script_args: str,
    flags: tuple[str, ...] = (),
    nproc: int = 2,
    wait: bool = True,
    timeout: float = 180,
    ckpt: Path | None = None,
) -> subprocess.Popen[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "steadfast.cli",
        "launch",
        f"--nproc-per-node={nproc}",
        "--monitor-interval=0.1",
        *flags,
        str(SCRIPT),
        "--ckpt",
        str(ckpt or workdir / "ckpt"),
        "--out",
        str(workdir / "out.pt"),
        *script_args,
    ]
    log = open(workdir / "launcher.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=workdir)
    log.close()
    if wait:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError((workdir / "launcher.log").read_text()[-4000:]) from None
    return proc


def _events(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


def _params(workdir: Path) -> dict[str, torch.Tensor]:
    return torch.load(workdir / "out.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    workdir = tmp_path_factory.mktemp("reference")
    proc = _launch(workdir, flags=tuple(TIMEOUTS))
    assert proc.returncode == 0, (workdir / "launcher.log").read_text()[-4000:]
    return _params(workdir)


def _assert_recovered(workdir: Path, proc: subprocess.Popen[str], reference) -> None:
    log = (workdir / "launcher.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    out = _params(workdir)
    assert out.keys() == reference.keys()
    assert all(torch.equal(out[k], reference[k]) for k in reference)  # bit for bit


@pytest.mark.parametrize(
    ("fault", "where", "cause", "kind", "proven"),
    [
        ("rank_hung", "step", "section:step", "rank_hung", True),
        ("rank_hung", "checkpointing", "section:checkpointing", "rank_hung", False),  # saving 4
        ("rank_hung", "out_of_section", "out_of_section", "rank_hung", True),
        ("rank_killed", "step", "signal SIGKILL", "rank_failed", True),
        ("exception", "step", "exit 1", "rank_failed", True),
        ("exit", "step", "exit 3", "rank_failed", True),
    ],
)
def test_fault_is_detected_and_the_run_recovers_bit_exact(
    tmp_path: Path,
    event_log: Path,
    reference,
    fault: str,
    where: str,
    cause: str,
    kind: str,
    proven: bool,
):
    flags = (*TIMEOUTS, "--max-restarts=2")
    if where == "out_of_section":
        # the peer waits for the hung rank inside its next step: with a shorter step
        # timeout it would be the one caught first (a victim, not the culprit)
        flags = (*flags, "--ft-rank_out_of_section_timeout", "1.5")
    proc = _launch(tmp_path, "--fault", fault, "--where", where, "--fault-step", "4", flags=flags)
    _assert_recovered(tmp_path, proc, reference)
    detected = [e for e in _events(event_log, kind) if e["cause"] == cause]
    # rank 1 has the fault; with a hang, rank 0 waits for it in a collective and times
    # out in the same section too
    assert 1 in {e["rank"] for e in detected}, _events(event_log, kind)
    restarts = _events(event_log, "restart")
    assert [e["restart_count"] for e in restarts] == [1]
    # checkpoints 2 and 4 before the fault (4 not complete when it hangs saving it): the
    # loop logs no losses, so checkpoint 2 is restored, and the state the loop reaches
    # at step 4 proven equal to checkpoint 4's (with 2 alone, nothing proves it)
    resumed = _events(event_log, "checkpoint_loaded")
    assert {e["step"] for e in resumed} == {2}
    if proven:
        [proof] = _events(event_log, "restore_verified")
        assert (proof["route"], proof["proof_steps"]) == ("state", 2)
        assert proof["against"] == str(tmp_path / "ckpt" / "step_4")
    else:
        [unproven] = _events(event_log, "restore_unverified")
        assert unproven["step"] == 2
    if kind == "rank_hung":  # the hung rank's stacks reached the log before it died
        assert "most recent call first" in (tmp_path / "launcher.log").read_text()


@pytest.mark.parametrize(
    ("fault_type", "kind", "cause"),
    [("rank_hung", "rank_hung", "section:step"), ("rank_killed", "rank_failed", "signal SIGKILL")],
)
def test_simulated_fault_megatron_bridge_names(
    tmp_path: Path, event_log: Path, reference, fault_type: str, kind: str, cause: str
):
    proc = _launch(
        tmp_path,
        "--simulate",
        fault_type,
        "--step-sleep",
        "0.25",
        flags=(*TIMEOUTS, "--max-restarts=1", "--ft-param-rank_out_of_section_timeout=2"),
    )
    _assert_recovered(tmp_path, proc, reference)
    injected = _events(event_log, "fault_injected")
    assert [(e["rank"], e["fault"]) for e in injected] == [(1, fault_type)]
    detected = _events(event_log, kind)
    # the simulated hang strikes 0.5-0.8 s in, at a random moment: in a step, between
    # steps, or (rarely) inside the save of step 2, which then times out on both ranks
    causes = (cause, "out_of_section", "section:checkpointing")
    assert any(e["rank"] == 1 and e["cause"] in causes for e in detected), detected


def test_rank_without_a_first_heartbeat(tmp_path: Path, event_log: Path, reference):
    proc = _launch(
        tmp_path,
        "--fault",
        "rank_hung",
        "--where",
        "start",
        flags=(
            *TIMEOUTS,
            "--max-restarts=1",
            "--ft-initial_rank_heartbeat_timeout",
            "8",  # the healthy rank's first beat comes ~1 s after its fork from the template
            "--ft-rank_heartbeat_timeout",
            "30",
        ),
    )
    _assert_recovered(tmp_path, proc, reference)
    hung = _events(event_log, "rank_hung")
    assert any(e["cause"] == "initial_heartbeat" and e["rank"] == 1 for e in hung), hung


def test_restarts_exhausted_exit_code(tmp_path: Path, event_log: Path):
    from steadfast.launcher import EXIT_RESTARTS_EXHAUSTED

    proc = _launch(tmp_path, "--fault", "rank_killed", flags=(*TIMEOUTS, "--max-restarts=0"))
    assert proc.returncode == EXIT_RESTARTS_EXHAUSTED
    # rank 1 was killed; rank 0 went down after it (its peer gone, or stopped by the
    # agent): one fault, counted once
    failed = {e["rank"]: e["cause"] for e in _events(event_log, "rank_failed")}
    assert failed == {1: "signal SIGKILL"}, failed
    stopped = _events(event_log, "rank_stopped")
    assert [(e["rank"], e["first_failed_rank"]) for e in stopped] == [(0, 1)]
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(
    ("earlier", "requeued"),
    [(("preempted", "preempted"), True), (("restarts_exhausted", "restart_elsewhere"), False)],
)
def test_job_retry_requeues_the_slurm_job(
    tmp_path: Path, event_log: Path, monkeypatch: pytest.MonkeyPatch, earlier, requeued
):
    """A stand-in ``scontrol`` on PATH records the call (the real Slurm tests are in
    tests/slurm). The job was requeued twice before (SLURM_RESTART_COUNT=2): for two
    preemptions, which spend no job retry, or for two failures, which spend both."""
    from steadfast import events
    from steadfast.launcher import EXIT_REQUEUED, EXIT_RESTARTS_EXHAUSTED

    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "scontrol.calls"
    scontrol = bindir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    for restart, cause in enumerate(earlier):  # the earlier incarnations' requeues
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        events.emit("job_requeued", cause=cause, slurm_job="4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    proc = _launch(
        tmp_path / "run",
        "--fault",
        "rank_killed",
        flags=(*TIMEOUTS, "--max-restarts=0", "--ft-num_job_retries_on_failure", "2"),
    )
    if requeued:
        assert proc.returncode == EXIT_REQUEUED
        assert calls.read_text().split() == ["requeue", "4242"]
        assert _events(event_log, "job_requeued")[-1]["cause"] == "restarts_exhausted"
    else:  # retries spent: no requeue
        assert proc.returncode == EXIT_RESTARTS_EXHAUSTED and not calls.exists()


def test_no_progress_across_restarts_exit_code(tmp_path: Path, event_log: Path):
    from steadfast.launcher import EXIT_NO_PROGRESS

    proc = _launch(
        tmp_path,
        "--fault",
        "exception",
        "--where",
        "setup",
        "--every-generation",
        flags=(*TIMEOUTS, "--max-restarts=10", "--ft-param-max_no_progress_restarts=2"),
    )
    assert proc.returncode == EXIT_NO_PROGRESS, (tmp_path / "launcher.log").read_text()[-3000:]
    assert len(_events(event_log, "restart")) == 2  # then the guard stopped it


def test_sigterm_to_the_launcher_reaches_the_workers_which_save(tmp_path: Path, event_log: Path):
    proc = _launch(
        tmp_path,
        "--step-sleep",
        "0.3",
        "--steps",
        "200",
        "--graceful",
        flags=tuple(TIMEOUTS),
        wait=False,
    )
    deadline = time.monotonic() + 120
    while not _events(event_log, "checkpoint_saved"):  # training is under way
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    requested = _events(event_log, "shutdown_requested")
    assert sorted(e["rank"] for e in requested) == [0, 1]  # forwarded to every worker
    agreed = _events(event_log, "shutdown_agreed")
    saved = _events(event_log, "checkpoint_saved")
    assert agreed and saved[-1]["step"] == agreed[0]["step"] + 1  # the emergency save
    assert _events(event_log, "rank_failed") == []  # a clean stop, not a crash
    # torch stops the workers itself on a signal: the generation still ends in the log,
    # before the launcher does (the report would count it running until then otherwise)
    (started,) = _events(event_log, "workers_started")
    (exited,) = _events(event_log, "workers_exited")
    (end,) = _events(event_log, "launcher_end")
    assert exited["cause"] == "stopped" and exited["generation"] == started["generation"]
    assert sorted(x["rank"] for x in exited["exits"]) == [0, 1]
    assert started["time"] < exited["time"] <= end["time"]


def test_calculated_timeouts_are_saved_and_used_after_a_restart(tmp_path: Path, event_log: Path):
    """A first run learns the step timeout and saves ft_state.json; the next run has no
    configured step timeout at all, so only the loaded calculated one can catch its
    hang."""
    first = _launch(tmp_path / "learn", "--calc-timeouts", flags=tuple(TIMEOUTS))
    assert first.returncode == 0, (tmp_path / "learn" / "launcher.log").read_text()[-3000:]
    state = json.loads((tmp_path / "learn" / "ckpt" / "ft_state.json").read_text())
    learned = state["current_timeouts"]["section"]["section"]["step"]  # NVRx's form
    assert 0 < learned < 2  # 5 x the slowest step seen (ms), not a configured value
    run = tmp_path / "use"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "ft_state.json").write_text(json.dumps(state))
    proc = _launch(
        run,
        "--fault",
        "rank_hung",
        "--fault-step",
        "4",
        flags=("--ft-param-rank_section_timeouts=setup:60", "--max-restarts=1"),
    )
    assert proc.returncode == 0, (run / "launcher.log").read_text()[-3000:]
    hung = [e for e in _events(event_log, "rank_hung") if e["cause"] == "section:step"]
    # enforced no lower than calculated_timeout_floor (1 s): a calculated 0.03 s would
    # end a healthy rank at its first pause
    floor = FaultToleranceConfig().calculated_timeout_floor
    assert hung and hung[0]["timeout"] == pytest.approx(max(learned, floor))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_launchers_form_a_two_node_job_and_restart_together(
    tmp_path: Path, event_log: Path, reference
):
    port = _free_port()
    flags = (
        *TIMEOUTS,
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-nodes",
        "--max-restarts=2",
    )
    workdir = tmp_path / "job"
    nodes = []
    for node in range(2):
        (workdir / f"node{node}").mkdir(parents=True)
        # one checkpoint directory for both nodes, as on a shared file system
        nodes.append(
            _launch(
                workdir / f"node{node}",
                "--fault",
                "rank_hung",
                "--fault-step",
                "4",
                flags=flags,
                nproc=1,
                wait=False,
                ckpt=workdir / "ckpt",
            )
        )
    for node in nodes:
        node.wait(240)
    logs = [(workdir / f"node{n}" / "launcher.log").read_text()[-3000:] for n in range(2)]
    assert [n.returncode for n in nodes] == [0, 0], logs
    hung = [e for e in _events(event_log, "rank_hung") if e["cause"] == "section:step"]
    assert hung and 1 in {e["rank"] for e in hung}
    assert len(_events(event_log, "restart")) >= 2  # every node restarted its workers
    out = torch.load(workdir / "node0" / "out.pt", weights_only=True)
    assert all(torch.equal(out[k], reference[k]) for k in reference)


def test_rerun_exit_16_restarts_elsewhere_and_the_run_ends_bit_exact(
    tmp_path: Path, event_log: Path, monkeypatch: pytest.MonkeyPatch, reference
):
    """The re-run state machine reproduces rank 1's NaN in place on "node-a": every
    worker saves and exits 16, which the launcher does not restart on the same hardware
    (it exits 16, with restarts to spare). Resubmitted on "node-b" (faked through the
    documented environment variable), the step is re-run from that checkpoint, the NaN
    is not reproduced (a persistent fault of the first GPU) and the run ends bit-exact."""
    from steadfast.launcher import EXIT_RESTART_ELSEWHERE
    from steadfast.rerun import HARDWARE_ID_ENV

    monkeypatch.setenv(HARDWARE_ID_ENV, "node-a")
    flags = (*TIMEOUTS, "--max-restarts=3")
    proc = _launch(tmp_path, "--rerun", "--nan-on", "node-a", flags=flags)
    assert proc.returncode == EXIT_RESTART_ELSEWHERE, (tmp_path / "launcher.log").read_text()[
        -4000:
    ]
    assert not _events(event_log, "restart")  # no in-job restart on the same hardware
    assert {e["exit_code"] for e in _events(event_log, "rank_failed")} == {16}
    assert [(e["rank"], e["step"]) for e in _events(event_log, "rerun_result_rejected")] == [(1, 5)]
    assert os.path.basename(os.readlink(tmp_path / "ckpt" / "latest")) == "step_5"
    monkeypatch.setenv(HARDWARE_ID_ENV, "node-b")
    proc = _launch(tmp_path, "--rerun", "--nan-on", "node-a", flags=flags)
    _assert_recovered(tmp_path, proc, reference)
    assert [e["cause"] for e in _events(event_log, "rerun_verdict")] == ["persistent"] * 2
    tracker = [json.loads(r) for r in (tmp_path / "ckpt" / "rerun_tracker.jsonl").open()]
    assert (tracker[0]["status"], tracker[0]["rank"], tracker[0]["device"]) == (
        "rejected",
        1,
        "node-a",
    )  # fmt: skip - who to blame


def test_rerun_exit_17_is_not_restarted(tmp_path: Path, event_log: Path):
    """A transient NaN with the fatal loss check: every worker exits 17 and the
    launcher neither restarts nor requeues the job."""
    from steadfast.launcher import EXIT_RESULT_VALIDATION_FAILED

    proc = _launch(
        tmp_path, "--rerun", "--fault", "nan_burst", flags=(*TIMEOUTS, "--max-restarts=3")
    )
    log = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == EXIT_RESULT_VALIDATION_FAILED, log[-4000:]
    assert "failed result validation (exit 17); not restarting" in log
    assert not _events(event_log, "restart") and not (tmp_path / "out.pt").exists()
    assert [e["cause"] for e in _events(event_log, "rerun_verdict")] == ["transient"] * 2


_SIGNALS_PARENT = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = os.environ["RANK"]
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
(out / f"ready_{rank}").write_text("")
if rank == "0":
    while not (out / "ready_1").exists():
        time.sleep(0.01)
    os.kill(os.getppid(), signal.SIGTERM)  # as NVRx's test_launcher_sigterm_graceful_exit
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
(out / f"stopped_{rank}").write_text("SIGTERM" if got else "timed out")
"""


def test_a_worker_signalling_its_parent_stops_the_launcher(tmp_path: Path, event_log: Path):
    """Under the default worker template a worker's parent is the template, which
    ignores the signals srun sends the whole step: one sent by a worker must reach the
    launcher, which stops every worker with it and exits 128+N (the job ends)."""
    script = tmp_path / "signals_parent.py"
    script.write_text(_SIGNALS_PARENT)
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--nproc-per-node=2",
        "--monitor-interval=0.1", str(script), str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert [(tmp_path / f"stopped_{r}").read_text() for r in (0, 1)] == ["SIGTERM"] * 2
