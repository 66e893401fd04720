"""Goodput arithmetic on a hand-written event log, the timeline picture, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from steadfast.events import EventLogError
from steadfast.report import compute_report, format_report, load_events, plot_timeline

A, B = 100, 200  # the pids of two process generations of rank 0


def _line(t: float, kind: str, rank: int | None = 0, step: int | None = None, **fields) -> str:
    return json.dumps({"time": t, "kind": kind, "rank": rank, "step": step, "cause": None,
                       "host": "h", "restart": 0, **fields})  # fmt: skip


LOG = [
    # generation A: starts at 0, first step done at 3; a checkpoint after step 3
    _line(2.0, "job_start", pid=A, process_start=0.0, world_size=2),
    *[_line(3.0 + i, "step_done", step=i, pid=A, seconds=1.0) for i in range(4)],
    _line(6.5, "checkpoint_saved", step=4, pid=A, seconds=0.5, blocking_seconds=0.5),
    _line(7.5, "step_done", step=4, pid=A, seconds=1.0),  # lost: re-done after the restart
    _line(8.5, "step_done", step=5, pid=A, seconds=1.0),
    _line(9.0, "fault_injected", rank=1, step=6, pid=101, fault="rank_killed"),
    _line(9.5, "rank_failed", rank=1, pid=50, exit_code=-9),  # the launcher saw it
    _line(9.6, "restart", rank=None, pid=50, restart_count=1),
    # generation B: process starts at 10, loads step_4, runs 4..7 (7 is slow)
    _line(11.0, "checkpoint_loaded", pid=B, seconds=0.5),
    _line(11.5, "job_start", step=4, pid=B, process_start=10.0, world_size=2),
    _line(12.5, "step_done", step=4, pid=B, seconds=1.0),
    _line(13.5, "step_done", step=5, pid=B, seconds=1.0),
    _line(14.5, "step_done", step=6, pid=B, seconds=1.0),
    _line(17.5, "step_done", step=7, pid=B, seconds=3.0),
]


def _write(tmp_path: Path, lines: list[str], name: str = "events.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_goodput_arithmetic(tmp_path: Path):
    evs, problems = load_events(_write(tmp_path, LOG))
    report = compute_report(evs, problems)
    assert report.wall_time == pytest.approx(17.5)  # process start of A to the last event
    # kept: steps 0-3 of A, 4-6 of B (1 s each) and step 7 at the median (1 s)
    assert report.productive_time == pytest.approx(8.0)
    assert report.goodput == pytest.approx(8.0 / 17.5)
    assert report.badput == pytest.approx({
        "startup": 2.0 + 1.0,  # A: 0 -> 2; B: 10 -> 11.5 less the 0.5 s load
        "checkpoint_load": 0.5,
        "checkpoint_save": 0.5,
        "wasted_progress": 2.0,  # A's steps 4 and 5, run again by B
        "detection": 0.5,  # the kill at 9.0, seen at 9.5
        "restart": 0.5,  # seen at 9.5, B's process started at 10
        "straggling": 2.0,  # step 7: 3 s against a 1 s median
        "teardown": 0.0,  # the log ends at the last step
        "other": 0.5,  # A's partial step 8.5 -> 9.0
    })  # fmt: skip
    assert (report.steps_done, report.steps_redone) == (8, 2)
    assert (report.generations, report.restarts) == (2, 1)
    (fault,) = report.faults
    assert (fault.fault, fault.rank, fault.step, fault.detected_by) == (
        "rank_killed", 1, 6, "rank_failed")  # fmt: skip
    assert fault.detection_latency == pytest.approx(0.5)
    assert fault.recovery_time == pytest.approx(3.0)  # 9.5 -> B's first step at 12.5
    assert report.all_recovered
    text = format_report(report)
    assert "goodput  45.7 %" in text
    assert "every injected fault (1) was detected and recovered" in text


def test_a_killed_ranks_detection_is_its_exit_not_the_stop_of_the_others(tmp_path: Path):
    """torch's agent writes ``rank_failed`` only once it stopped the other workers (the
    survivor here took 0.4 s to exit): the kill was detected when the launcher's watcher
    saw the rank end (``workers_exited``'s exit time, 9.1), and the stop is the
    restart's. The goodput is the same; detection and restart are split where they
    happened."""
    log = [line for line in LOG if '"rank_failed"' not in line]
    at = log.index(next(line for line in log if '"restart"' in line))
    exits = [{"rank": 1, "exit_code": -9, "time": 9.1}, {"rank": 0, "exit_code": 1, "time": 9.45}]
    log[at:at] = [
        _line(9.5, "rank_failed", rank=1, pid=50, exit_code=-9),
        _line(9.5, "workers_exited", rank=None, pid=50, exits=exits),
    ]
    report = compute_report(load_events(_write(tmp_path, log))[0])
    assert report.badput["detection"] == pytest.approx(0.1)  # 9.0 -> 9.1
    assert report.badput["restart"] == pytest.approx(0.9)  # 9.1 -> B's start at 10
    assert report.goodput == pytest.approx(8.0 / 17.5)
    (fault,) = report.faults
    assert fault.detection_latency == pytest.approx(0.1)
    assert fault.recovery_time == pytest.approx(3.4)  # 9.1 -> B's first step at 12.5


def test_the_launchers_own_start_is_start_up_not_other(tmp_path: Path):
    """Before the first worker process exists, the launcher starts and spawns it: that
    is the run's start-up (it was left to "other"), as a requeue's is its restart."""
    launcher = json.dumps({"time": -1.5, "kind": "launcher_start", "rank": None, "step": None,
                           "cause": None, "host": "h", "pid": 50, "restart": 0})  # fmt: skip
    evs, problems = load_events(_write(tmp_path, [launcher, *LOG]))
    report = compute_report(evs, problems)
    assert report.wall_time == pytest.approx(19.0)
    assert report.badput["startup"] == pytest.approx(1.5 + 2.0 + 1.0)
    assert report.badput["other"] == pytest.approx(0.5)


def test_nan_burst_rollback_and_undetected_fault(tmp_path: Path):
    lines = [
        _line(1.0, "job_start", pid=A, process_start=0.0),
        *[_line(2.0 + i, "step_done", step=i, pid=A, seconds=1.0) for i in range(3)],
        _line(4.2, "fault_injected", rank=1, step=3, pid=101, fault="nan_burst"),
        _line(4.5, "nan_detected", rank=0, step=3, pid=A),
        _line(5.0, "step_done", step=3, pid=A, seconds=1.0),  # skipped, then rolled back
        _line(5.5, "rollback", step=2, pid=A, to_step=2),
        _line(6.5, "step_done", step=2, pid=A, seconds=1.0),
        _line(7.5, "step_done", step=3, pid=A, seconds=1.0),
        _line(8.0, "fault_injected", rank=1, step=4, pid=101, fault="rank_hung"),
    ]
    report = compute_report(load_events(_write(tmp_path, lines))[0])
    nan, hang = report.faults
    assert (nan.detected_by, nan.detection_latency) == ("nan_detected", pytest.approx(0.3))
    assert nan.recovery_time == pytest.approx(2.0)  # detected 4.5, first step after rollback
    assert report.badput["wasted_progress"] == pytest.approx(2.0)  # steps 2 and 3, run twice
    assert hang.detected_by is None and not report.all_recovered
    assert "NOT every fault was detected and recovered: rank_hung" in format_report(report)


def test_bad_input_is_named_and_the_rest_is_used(tmp_path: Path):
    path = _write(tmp_path, [*LOG, _line(18.0, "mystery_kind", pid=A)])
    with path.open("a") as fh:
        fh.write('{"time": 19.0, "kind": "step_do')  # a truncated last line
    evs, problems = load_events(path)
    assert len(evs) == len(LOG) + 1
    assert any("not valid JSON" in p and "events.jsonl:" in p for p in problems)
    assert any("unknown event kind 'mystery_kind'" in p for p in problems)
    report = compute_report(evs, problems)
    assert report.productive_time == pytest.approx(8.0)
    assert "note: unknown event kind" in format_report(report)
    empty = _write(tmp_path, [], "events-empty.jsonl")
    with pytest.raises(EventLogError, match="no events could be read"):
        load_events(empty)
    with pytest.raises(EventLogError, match="nowhere: no such file or directory"):
        load_events(tmp_path / "nowhere")


def test_timeline_png_is_written(tmp_path: Path):
    pytest.importorskip("matplotlib")
    evs, _ = load_events(_write(tmp_path, LOG))
    out = plot_timeline(evs, tmp_path / "pic" / "timeline.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_report_command(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    _write(run, LOG)
    proc = subprocess.run([sys.executable, "-m", "steadfast.cli", "report", str(run), "--json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["goodput"] == pytest.approx(8.0 / 17.5) and out["all_recovered"]
    assert Path(out["timeline"]).is_file()
    proc = subprocess.run([sys.executable, "-m", "steadfast.cli", "report", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "steadfast report:" in proc.stderr
    assert "no such file or directory" in proc.stderr


def test_process_start_time_is_accurate_to_a_few_ticks():
    """Start-up time is measured from it, so it must not be off by the whole second that
    /proc/stat's integer boot time would give."""
    import time

    from steadfast.events import process_start_time

    before = time.time()
    child = subprocess.Popen(["sleep", "5"])
    try:
        started = process_start_time(child.pid)
        assert started is not None and abs(started - before) < 0.1
    finally:
        child.kill()
        child.wait()
    assert process_start_time(2**22 + 1) is None  # no such process


def _launcher_log(tmp_path: Path) -> Path:
    """What the launchers of a plain script write: node1..node3 start, node4 waits as a
    spare; node2 is lost at t=20 (0.5 s after its last beat), node4 takes its place."""

    def e(t: float, kind: str, host: str, **fields: object) -> str:
        base = {"time": t, "kind": kind, "rank": None, "step": None, "cause": None,
                "host": host, "pid": 7, "restart": 0}  # fmt: skip
        return json.dumps({**base, **fields})

    def started(t: float, host: str, gen: int, node_rank: int) -> str:
        return e(t, "workers_started", host, generation=gen, restart_count=gen - 1,
                 node_rank=node_rank, nodes=3, world_size=3, ranks=[node_rank],
                 pids=[100])  # fmt: skip

    def exited(t: float, host: str, gen: int, cause: str) -> str:
        exits = [{"rank": 0, "local_rank": 0, "pid": 100, "exit_code": 0, "signal": None,
                  "time": t - 0.01}]  # fmt: skip
        return e(t, "workers_exited", host, cause=cause, generation=gen, exits=exits,
                 seconds=1.0)  # fmt: skip

    lines = [
        *(e(0.0 + i, "launcher_start", f"node{i + 1}", nnodes="3") for i in range(3)),
        started(4.0, "node1", 1, 0), started(4.2, "node2", 1, 1), started(4.4, "node3", 1, 2),
        e(10.0, "launcher_start", "node4", nnodes="3"),
        e(20.0, "node_lost", "node1", cause="connection_reset", node="node2", latency=0.5),
        exited(20.3, "node1", 1, "stopped"), exited(20.4, "node3", 1, "stopped"),
        e(21.0, "node_joined", "node1", cause="spare", node="node4", replaced=["node2"]),
        started(22.0, "node1", 2, 0), started(22.1, "node3", 2, 1), started(22.5, "node4", 1, 2),
        exited(40.0, "node1", 2, "succeeded"), exited(40.0, "node3", 2, "succeeded"),
        exited(40.1, "node4", 1, "succeeded"),
        *(e(40.3, "launcher_end", h, exit_code=0, reason="ok")
          for h in ("node1", "node3", "node4")),
    ]  # fmt: skip
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join(lines) + "\n")
    return log


def test_a_plain_scripts_run_is_told_from_its_launchers(tmp_path: Path) -> None:
    evs, problems = load_events(_launcher_log(tmp_path))
    report = compute_report(evs, problems)
    view = report.launchers
    assert view is not None and not problems
    assert report.wall_time == pytest.approx(40.3)  # first launcher start -> last end
    assert [g.nodes for g in view.generations] == [
        ["node1", "node2", "node3"],
        ["node1", "node3", "node4"],
    ]
    first, second = view.generations
    assert (first.start, first.outcome, first.in_job_restart) == (4.4, "stopped", False)
    assert (second.start, second.outcome, second.in_job_restart) == (22.5, "succeeded", True)
    assert report.generations == 2 and report.restarts == 1
    (fault,) = view.faults
    assert (fault.what, fault.node, fault.cause) == ("node lost", "node2", "connection_reset")
    assert fault.detection_latency == 0.5 and fault.next_generation == pytest.approx(2.5)
    assert fault.cost == pytest.approx(3.0) and fault.replaced_by == ["node4"]
    # start-up 4.4, running 4.4 -> 19.5 (the fault began) and 22.5 -> 40.09 (node4's
    # worker, the last), lost 3.0, the end 40.09 -> 40.3: they add up to the wall time
    assert view.startup == pytest.approx(4.4)
    assert view.running == pytest.approx(15.1 + 17.59)
    assert view.ending == pytest.approx(0.21)
    assert view.startup + view.running + view.lost + view.ending == pytest.approx(40.3)
    text = format_report(report)
    assert "productive time  unknown" in text and 'emit("step_done"' in text
    assert "verdict: 1 fault(s) seen, each followed by a new generation" in text
    assert "node2: no end recorded" in text
    pytest.importorskip("matplotlib")
    assert plot_timeline(evs, tmp_path / "t.png").stat().st_size > 5000


def test_a_launcher_with_no_end_is_named_and_no_end_is_claimed(tmp_path: Path) -> None:
    """The run of issue 36 as its log told it: node4, the spare, never wrote its
    workers' end nor its own while node1 and node3 ended. The report names node4's
    launcher, with the time of its last event, says the end is unknown, and does not call
    the generation node4 ran in succeeded (it said so, and "end 0.06 s")."""
    log = _launcher_log(tmp_path)
    lines = log.read_text().splitlines()
    kept = [ln for ln in lines if not ('"node4"' in ln and ('"workers_exited"' in ln
            or '"launcher_end"' in ln))]  # fmt: skip
    assert len(kept) == len(lines) - 2
    log.write_text("\n".join(kept) + "\n")
    evs, problems = load_events(log)
    report = compute_report(evs, problems)
    view = report.launchers
    assert view is not None
    (running,) = view.running_launchers
    assert (running.host, running.last) == ("node4", 22.5)  # its workers_started
    assert [u.host for u in view.unended if u.lost] == ["node2"]
    assert view.generations[1].outcome == "no end on node4"
    text = format_report(report)
    assert "end               unknown   NO END recorded for the launcher of node4 " in text
    assert "(last event at 22.50 s)" in text
    assert "last worker exit -> last launcher end" not in text
    assert "node2: no end recorded, lost with the node" in text


def test_a_hung_ranks_kill_is_one_fault_and_a_relaunched_launcher_starts_its_own_count(
    tmp_path: Path,
) -> None:
    """One node, the demo's shape: a hang seen on two ranks, then the hung rank killed
    (rank_failed), is one fault's events; its cost is counted once. A launcher started
    again on the node (a resumed job) numbers its generations from 1 again: its exits
    are matched to its own, not to the first launcher's generation 1."""

    def e(t: float, kind: str, pid: int, **fields: object) -> str:
        base = {"time": t, "kind": kind, "rank": None, "step": None, "cause": None,
                "host": "vm", "pid": pid, "restart": 0}  # fmt: skip
        return json.dumps({**base, **fields})

    def gen(t0: float, t1: float, pid: int, g: int, cause: str) -> list[str]:
        exits = [{"rank": 0, "local_rank": 0, "pid": 1, "exit_code": 0, "signal": None,
                  "time": t1}]  # fmt: skip
        return [e(t0, "workers_started", pid, generation=g, node_rank=0, nodes=1,
                  world_size=2, ranks=[0, 1], pids=[1, 2]),
                e(t1 + 0.01, "workers_exited", pid, cause=cause, generation=g,
                  exits=exits)]  # fmt: skip

    lines = [
        e(0.0, "launcher_start", 7), *gen(1.0, 5.0, 7, 1, "failed"),
        e(4.9, "rank_hung", 7, rank=0, cause="section:step", elapsed=1.0),
        e(4.9, "rank_hung", 7, rank=1, cause="section:step", elapsed=1.0),
        e(5.0, "rank_failed", 7, rank=1, cause="signal SIGKILL", worker_pid=2),
        *gen(6.0, 9.0, 7, 2, "succeeded"), e(9.1, "launcher_end", 7, exit_code=0),
        e(10.0, "launcher_start", 8), *gen(11.0, 14.0, 8, 1, "succeeded"),
        e(14.1, "launcher_end", 8, exit_code=0),
    ]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    evs, _ = load_events(tmp_path)
    view = compute_report(evs).launchers
    assert view is not None
    assert [(g.start, g.end, g.outcome) for g in view.generations] == [
        (1.0, 5.0, "failed"),
        (6.0, 9.0, "succeeded"),
        (11.0, 14.0, "succeeded"),
    ]
    assert [(f.what, f.rank) for f in view.faults] == [("rank hung", 0), ("rank hung", 1)]
    assert all(f.cost == pytest.approx(2.1) for f in view.faults)  # 3.9 -> 6.0
    assert view.lost == pytest.approx(2.1)  # the two verdicts share their window


def test_a_generation_with_no_end_recorded_runs_at_most_until_the_next_one(
    tmp_path: Path,
) -> None:
    """A launcher killed (or one of a version that wrote no ``workers_exited`` when torch
    stopped the workers on a signal) leaves a generation open: it is counted running until
    the next generation starts, never past it, so running time stays within the wall."""

    def e(t: float, kind: str, **fields: object) -> str:
        base = {"time": t, "kind": kind, "rank": None, "step": None, "cause": None,
                "host": "vm", "pid": 7, "restart": 0}  # fmt: skip
        return json.dumps({**base, **fields})

    def started(t: float, g: int) -> str:
        return e(t, "workers_started", generation=g, node_rank=0, nodes=1, world_size=1,
                 ranks=[0], pids=[100 + g])  # fmt: skip

    lines = [
        e(0.0, "launcher_start"), started(1.0, 1), started(5.0, 2), started(9.0, 3),
        e(10.0, "workers_exited", cause="succeeded", generation=3, exits=[]),
        e(10.5, "launcher_end", exit_code=0),
    ]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    evs, _ = load_events(tmp_path)
    view = compute_report(evs).launchers
    assert view is not None
    assert [(g.start, g.end) for g in view.generations] == [(1.0, None), (5.0, None), (9.0, 10.0)]
    assert view.running == pytest.approx(9.0)  # 1 -> 5 -> 9 -> 10
    assert view.running <= view.wall_time


def test_a_plain_scripts_steps_and_a_hang_with_no_culprit_told_apart(tmp_path: Path):
    """A script that reports nothing: its launcher's steps_seen give the steps and the
    goodput; a hang where every rank waited in the same collective is printed as such,
    with no culprit guessed."""
    lines = [
        _line(0.0, "launcher_start", rank=None, pid=50, nnodes="1:1", nproc_per_node="2"),
        _line(1.0, "workers_started", rank=None, pid=50, generation=1, restart_count=0,
              node_rank=0, nodes=1, world_size=2, ranks=[0, 1], pids=[A, A + 1]),
        _line(12.0, "steps_seen", rank=0, pid=50, local_rank=0, worker_pid=A, generation=1,
              first=1, ends=[2.0, 3.0, 4.0, 5.0], base=None),
        _line(10.2, "hang_confirmed", rank=None, pid=50, cause="no_progress", culprit=None,
              where=None, waiting={"all_reduce": [0, 1]}, moving=[], stack=[],
              summary="no culprit could be told apart; 2 ranks waited in `all_reduce`"),
        _line(10.2, "rank_hung", rank=0, pid=50, local_rank=0, section="no_progress",
              elapsed=5.2, timeout=5.0, learned=True, worker_pid=A),
        _line(10.3, "workers_exited", rank=None, pid=50, generation=1, exits=[], seconds=9.3),
        _line(12.5, "launcher_end", rank=None, pid=50, exit_code=1, reason="failed"),
    ]  # fmt: skip
    evs, problems = load_events(_write(tmp_path, lines))
    assert not problems, problems
    report = compute_report(evs)
    assert report.steps_done == 4 and report.steps_redone is None
    assert report.productive_time == pytest.approx(3.0)  # the first counts as start-up
    text = format_report(report)
    assert "re-done unknown" in text
    assert "no culprit could be told apart; 2 ranks waited in `all_reduce`" in text


def test_a_plain_scripts_lost_time_is_told_by_cause(tmp_path: Path) -> None:
    """A script that reports nothing still gets its lost time by cause: start-up and
    the checkpoint load from the launchers' first_step (process start to the first
    iteration's end), detection from the last iteration seen to the launcher's verdict,
    restart from there to the next generation's process start. Before, all of it was
    'other', beside a fault table that said 5 s of detection."""
    lines = [
        _line(0.0, "launcher_start", rank=None, pid=50, nnodes="1:1", nproc_per_node="2"),
        _line(0.5, "workers_started", rank=None, pid=50, generation=1, restart_count=0,
              node_rank=0, nodes=1, world_size=2, ranks=[0, 1], pids=[A, A + 1]),
        _line(2.0, "first_step", rank=0, pid=50, local_rank=0, worker_pid=A, generation=1,
              process_start=0.6, first_step_end=2.0, checkpoint_load=0.0),
        _line(10.0, "rank_hung", rank=1, pid=50, local_rank=1, section="no_progress",
              elapsed=5.0, timeout=5.0, learned=True, worker_pid=A + 1),
        _line(10.1, "steps_seen", rank=0, pid=50, local_rank=0, worker_pid=A, generation=1,
              first=1, ends=[2.0, 3.0, 4.0, 5.0], base=0),
        _line(10.5, "workers_started", rank=None, pid=50, generation=2, restart_count=1,
              node_rank=0, nodes=1, world_size=2, ranks=[0, 1], pids=[A + 2, A + 3]),
        _line(12.0, "first_step", rank=0, pid=50, local_rank=0, worker_pid=A + 2,
              generation=2, process_start=11.0, first_step_end=12.0, checkpoint_load=0.25),
        _line(15.1, "steps_seen", rank=0, pid=50, local_rank=0, worker_pid=A + 2,
              generation=2, first=1, ends=[12.0, 13.0, 14.0, 15.0], base=2),
        _line(15.2, "launcher_end", rank=None, pid=50, exit_code=0, reason="succeeded"),
    ]  # fmt: skip
    evs, problems = load_events(_write(tmp_path, lines))
    assert not problems, problems
    report = compute_report(evs)
    lost = report.badput
    assert lost["startup"] == pytest.approx(2.0 + 0.75)  # 0 -> 2.0; 11.0 -> 12.0 less the load
    assert lost["checkpoint_load"] == pytest.approx(0.25)
    assert lost["detection"] == pytest.approx(5.0)  # the last iteration (5.0) -> rank_hung
    assert lost["restart"] == pytest.approx(1.0)  # rank_hung -> the next process start
    assert lost["wasted_progress"] == pytest.approx(2.0)  # steps 2 and 3 re-done (base 2)
    assert lost["other"] < 1.0, lost


def test_steps_without_seconds_are_timed_from_the_step_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's second loop writes only its step and loss: each step's time is the
    time since the step before in its process, less the save between them; a process's
    first step is its start-up (from the launcher process's start, the launchers'
    ``first_step`` giving the worker's); after the last step, the end is "teardown"."""
    w = 300
    lines = [
        _line(0.0, "launcher_start", rank=None, pid=50, process_start=-1.0),
        _line(1.0, "workers_started", rank=None, pid=50, pids=[w], ranks=[0], world_size=1),
        *[_line(3.0 + 0.5 * i, "step_done", step=i, pid=w, loss=1.0) for i in range(4)],
        _line(4.6, "checkpoint_saved", step=4, pid=w, seconds=0.1, blocking_seconds=0.1),
        _line(5.0, "step_done", step=4, pid=w, loss=1.0),  # 0.5 s, less the 0.1 s save
        _line(
            5.5,
            "first_step",
            rank=0,
            pid=50,
            worker_pid=w,
            process_start=1.2,
            first_forward=2.5,
            first_step_end=3.0,
        ),
        _line(
            6.0,
            "workers_exited",
            rank=None,
            pid=50,
            cause="succeeded",
            exits=[{"rank": 0, "pid": w, "exit_code": 0, "time": 5.8}],
        ),
        _line(6.2, "launcher_end", rank=None, pid=50, exit_code=0),
    ]
    evs = load_events(_write(tmp_path, lines))[0]
    report = compute_report(evs)
    assert report.wall_time == pytest.approx(7.2)  # the launcher process's start: -1.0
    assert report.productive_time == pytest.approx(4 * 0.5 - 0.1)  # steps 1-4
    assert report.badput["startup"] == pytest.approx(4.0)  # -1.0 -> the first step's end
    assert report.badput["checkpoint_save"] == pytest.approx(0.1)
    assert report.badput["teardown"] == pytest.approx(1.2)  # the last step -> the end
    assert report.badput["other"] == pytest.approx(0.0, abs=1e-9)
    assert report.goodput == pytest.approx(1.9 / 7.2)
    assert report.steps_done == 5
    # the timeline draws each step where it ran: its bars are the steps' time (the first,
    # start-up, none), the save's its own
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn: list[list[tuple[float, float]]] = []
    draw = Axes.broken_barh

    def watched(self, xranges, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append(list(xranges))
        return draw(self, xranges, *args, **kwargs)

    monkeypatch.setattr(Axes, "broken_barh", watched)
    plot_timeline(evs, tmp_path / "timeline.png")
    steps, saves = drawn[0], drawn[1]
    assert sum(w for _, w in steps) == pytest.approx(report.productive_time)
    assert [w for _, w in saves] == [pytest.approx(0.1)]
    # a slow-looking step of a millisecond loop is jitter, not straggling
    fast = [_line(10.0 + 0.001 * i + 0.003 * (i % 7 == 0), "step_done", step=i, pid=w)
            for i in range(100)]  # fmt: skip
    jitter = compute_report(load_events(_write(tmp_path, fast, "fast.jsonl"))[0])
    assert jitter.badput["straggling"] == 0.0 and jitter.badput["other"] == pytest.approx(0.0)


def test_a_fault_has_one_latency_in_both_tables(tmp_path: Path) -> None:
    """A killed rank is seen as it ends (its pidfd): the launchers' table gives the
    injection -> that exit, as the injected-faults table does, not the exit -> the
    ``rank_failed`` written once the others stopped; a hang's confirmation is told of
    the hang in its own generation, not of a kill 13 s before it."""
    exits = [{"rank": 1, "pid": 11, "exit_code": -9, "time": 10.02},
             {"rank": 0, "pid": 10, "exit_code": 1, "time": 10.6}]  # fmt: skip
    lines = [
        _line(0.0, "launcher_start", rank=None, pid=50),
        _line(1.0, "workers_started", rank=None, pid=50, pids=[10, 11], ranks=[0, 1]),
        _line(10.0, "fault_injected", rank=1, step=7, pid=11, fault="rank_killed"),
        _line(10.65, "rank_failed", rank=1, pid=50, worker_pid=11, exit_code=-9),
        _line(10.7, "workers_exited", rank=None, pid=50, cause="failed", exits=exits),
        _line(11.0, "workers_started", rank=None, pid=50, pids=[20, 21], ranks=[0, 1]),
        _line(23.0, "rank_hung", rank=1, pid=50, elapsed=1.8, cause="section:step"),
        _line(
            23.1,
            "hang_confirmed",
            rank=None,
            pid=50,
            culprit=1,
            cause="section:step",
            summary="rank 1 stopped in `f (x.py:1)`",
        ),
        _line(24.0, "workers_started", rank=None, pid=50, pids=[30, 31], ranks=[0, 1]),
        _line(25.0, "launcher_end", rank=None, pid=50, exit_code=0),
    ]
    report = compute_report(load_events(_write(tmp_path, lines))[0])
    (killed,) = report.faults
    assert killed.detection_latency == pytest.approx(0.02)
    view = report.launchers
    assert view is not None
    failed, hung = view.faults
    assert (failed.what, failed.time) == ("rank failed", pytest.approx(10.02))
    assert failed.detection_latency == pytest.approx(0.02)  # the same figure
    assert failed.next_generation == pytest.approx(0.98)  # the stop is the restart's
    assert failed.summary is None and hung.summary is not None
    assert hung.detection_latency == pytest.approx(1.8)  # from its last sign of life
    text = format_report(report)
    assert "from its injection where one was logged" in text
    assert "(latency: the injection -> its detection" in text
