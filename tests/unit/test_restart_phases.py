"""The report's restarts (steadfast.report.restarts) on written logs: what counts as a
restart (an in-job one, a relaunch of an ended job; not a spare's first round), the
phases adding up to the fault-to-first-step time, a log that lacks the timings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from steadfast.report import compute_report, format_report, load_events

T = 1_000.0


def ev(t: float, kind: str, host: str = "n1", pid: int = 10, **fields: Any) -> dict[str, Any]:
    return {"time": T + t, "kind": kind, "rank": fields.pop("rank", None), "step": None,
            "cause": fields.pop("cause", None), "host": host, "pid": pid, "restart": 0,
            **fields}  # fmt: skip


def started(t: float, gen: int, pids: list[int], host: str = "n1", pid: int = 10) -> dict:
    return ev(t, "workers_started", host, pid, generation=gen, restart_count=gen - 1,
              node_rank=0, nodes=1, world_size=1, ranks=[0], pids=pids, health_check=0.01,
              rendezvous=[T + t - 0.2, T + t - 0.1], spawn=T + t - 0.05)  # fmt: skip


def first(t: float, gen: int, worker: int, host: str = "n1", pid: int = 10) -> dict:
    return ev(t, "first_step", host, pid, rank=0, local_rank=0, worker_pid=worker,
              generation=gen, process_start=T + t - 1.0, first_forward=T + t - 0.2,
              first_step_end=T + t, imports=0.1, init_process_group=0.3, checkpoint_load=0.2,
              compile=0.0, first_batch=0.05, setup=0.15, first_step=0.2)  # fmt: skip


def exited(t: float, gen: int, cause: str, host: str = "n1", pid: int = 10) -> dict:
    exits = [{"rank": 0, "local_rank": 0, "pid": 1, "exit_code": -9 if cause == "failed" else 0,
              "signal": None, "time": T + t - 0.1}]  # fmt: skip
    return ev(t, "workers_exited", host, pid, cause=cause, generation=gen, exits=exits, seconds=1)


def report(tmp_path: Path, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    evs, problems = load_events(log)
    assert not problems
    result = compute_report(evs)
    format_report(result)  # prints every restart
    return result.restarts_phases


def launcher(t: float, host: str = "n1", pid: int = 10) -> dict[str, Any]:
    return ev(t, "launcher_start", host, pid, nnodes="1", nproc_per_node=1, entrypoint="x",
              max_restarts=3, rdzv_backend="c10d")  # fmt: skip


def test_an_in_job_restart_adds_up_from_the_kill_to_the_first_step(tmp_path: Path):
    (restart,) = report(tmp_path, [
        launcher(0), started(1, 1, [1]), first(3, 1, 1),
        ev(9.9, "fault_injected", rank=0, fault="rank_killed"),
        ev(10.05, "rank_failed", rank=0, cause="signal SIGKILL", exit_code=-9),
        exited(10.1, 1, "failed"), started(10.5, 2, [2]), first(12, 2, 2),
    ])  # fmt: skip
    assert restart["kind"] == "in-job" and restart["what"] == "rank 0 failed (signal SIGKILL)"
    assert restart["seconds"] == pytest.approx(12 - 9.9)
    assert sum(restart["phases"].values()) == pytest.approx(restart["seconds"])
    assert restart["phases"]["detection"] == pytest.approx(0.1)  # the watcher saw the exit


def test_a_spares_first_round_is_not_a_restart_and_a_relaunch_is_a_requeue(tmp_path: Path):
    spare = [launcher(5, "n2", 20), started(10.5, 1, [3], "n2", 20), first(12, 1, 3, "n2", 20)]
    found = report(tmp_path, [
        launcher(0), started(1, 1, [1]), first(3, 1, 1),
        ev(10.05, "node_lost", node="n0", latency=0.05, how="x", nodes=2),
        exited(10.1, 1, "stopped"), *spare, started(10.5, 2, [2]), first(12, 2, 2),
        exited(20, 2, "succeeded"), exited(20, 1, "succeeded", "n2", 20),
        ev(20.5, "launcher_end", exit_code=0, reason="x"),
        ev(20.5, "launcher_end", "n2", 20, exit_code=0, reason="x"),
        launcher(30, "n1", 30), started(33, 1, [4], "n1", 30), first(35, 1, 4, "n1", 30),
    ])  # fmt: skip
    assert [(r["kind"], [n["host"] for n in r["nodes"]]) for r in found] == [
        ("in-job", ["n1"]),  # the spare n2 joined the round: not a restart of its own
        ("requeue", ["n1"]),  # every launcher had ended: the job's next incarnation
    ]
    assert found[1]["phases"]["requeue"] > 0


def test_a_log_without_the_start_timings_stops_at_what_it_has(tmp_path: Path):
    old = started(10.5, 2, [2])
    for name in ("rendezvous", "spawn", "health_check"):
        del old[name]
    (restart,) = report(tmp_path, [
        launcher(0), started(1, 1, [1]),
        ev(10.05, "rank_failed", rank=0, cause="exit 1", exit_code=1),
        exited(10.1, 1, "failed"), old,
    ])  # fmt: skip
    assert restart["seconds"] is None and "phases to the spawn only" in restart["notes"][0]
    assert set(restart["phases"]) == {"detection", "stopping", "launcher"}
