"""The timeline of a multi-node run (issue 30): lanes grouped by node, a lost node, a
spare joining and a requeue marked across every lane, each fault's culprit highlighted.

The log is what the launchers of 3 nodes x 2 ranks and a spare write: rank 3 on node2
is killed (node1's rank 1 then fails on its own, its collective's peer gone: not a
culprit), then node2 is lost and the spare node4 takes its ranks, then the job is
preempted and requeued, and its launchers start again. Every node's launcher writes
each fault's ``fault_culprit``; the same log without them must name the same culprits
from the launchers' own fault events.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from steadfast.report import load_events, plot_timeline
from steadfast.report.timeline_nodes import is_multinode, node_layout

T0 = 1000.0
SEATS = {"node1": [0, 1], "node2": [2, 3], "node3": [4, 5], "node4": [2, 3]}
NODE_RANK = {"node1": 0, "node2": 1, "node3": 2, "node4": 1}


def e(t: float, kind: str, host: str, rank: int | None = None, **fields: Any) -> dict[str, Any]:
    return {"time": T0 + t, "kind": kind, "rank": rank, "step": None, "cause": None,
            "host": host, "pid": 7, "restart": 0, **fields}  # fmt: skip


def pids(host: str, gen: int) -> list[int]:
    return [100 * gen + r for r in SEATS[host]]


def started(t: float, host: str, gen: int) -> dict[str, Any]:
    return e(t, "workers_started", host, generation=gen, restart_count=gen - 1,
             node_rank=NODE_RANK[host], nodes=3, world_size=6, ranks=SEATS[host],
             pids=pids(host, gen))  # fmt: skip


def exited(t: float, host: str, gen: int, cause: str, codes: list[int]) -> dict[str, Any]:
    exits = [
        {"rank": r, "local_rank": i, "pid": p, "exit_code": c, "signal": None, "time": T0 + t - 0.1}
        for i, (r, p, c) in enumerate(zip(SEATS[host], pids(host, gen), codes, strict=True))
    ]
    return e(t, "workers_exited", host, cause=cause, generation=gen, exits=exits, seconds=1.0)


def culprit(t: float, host: str, fault: str, what: str, rank: int | None, at: float,
            cause: str) -> dict[str, Any]:  # fmt: skip
    return e(t, "fault_culprit", host, cause=cause, fault_id=fault, what=what, node="node2",
             node_rank=1, culprit_rank=rank, fault_time=T0 + at, claims=1,
             stopped=[])  # fmt: skip


def _log(verdicts: bool = True, requeued: bool = True) -> list[dict[str, Any]]:
    three = ("node1", "node2", "node3")
    lines = [
        *(e(0.1 * i, "launcher_start", h, nnodes="3") for i, h in enumerate(three)),
        *(started(2.0 + 0.1 * i, h, 1) for i, h in enumerate(three)),
        e(5.0, "launcher_start", "node4", nnodes="3"),  # the spare waits
        # round 1: rank 3 on node2 is killed (its exit 10.1); node1's rank 1 fails on
        # its own at 10.3 (its peer gone), the rest are stopped
        e(10.1, "rank_failed", "node2", 3, cause="SIGKILL", exit_code=-9, worker_pid=103),
        e(10.1, "rank_stopped", "node2", 2, first_failed_rank=3),
        e(10.3, "rank_failed", "node1", 1, cause="exit 1", exit_code=1, worker_pid=101),
        exited(10.2, "node2", 1, "failed", [-15, -9]),
        exited(10.4, "node1", 1, "failed", [-15, 1]),
        exited(10.4, "node3", 1, "stopped", [-15, -15]),
        *(started(12.0 + 0.1 * i, h, 2) for i, h in enumerate(three)),
        # round 2: node2 loses its power at 19.5, found at 20.0 by node1 and node3
        e(20.0, "node_lost", "node1", cause="connection_reset", node="node2", latency=0.5),
        e(20.1, "node_lost", "node3", cause="connection_reset", node="node2", latency=0.6),
        exited(20.3, "node1", 2, "stopped", [-15, -15]),
        exited(20.3, "node3", 2, "stopped", [-15, -15]),
        e(21.0, "node_joined", "node1", cause="spare", node="node4", replaced=["node2"]),
        started(22.0, "node1", 3),
        started(22.1, "node3", 3),
        started(22.2, "node4", 1),
        # round 3: the job is preempted at 30, requeued, and starts again at 60
        *(
            exited(30.2, h, g, "stopped", [-15, -15])
            for h, g in (("node1", 3), ("node3", 3), ("node4", 1))
        ),
        *(
            e(30.5, "launcher_end", h, exit_code=143, reason="preempted")
            for h in ("node1", "node3", "node4")
        ),
        *(
            e(60.0 + 0.1 * i, "launcher_start", h, nnodes="3")
            for i, h in enumerate(("node1", "node3", "node4"))
        ),
        started(62.0, "node1", 1),
        started(62.1, "node3", 1),
        started(62.2, "node4", 1),
        *(exited(70.0, h, 1, "succeeded", [0, 0]) for h in ("node1", "node3", "node4")),
        *(
            e(70.5, "launcher_end", h, exit_code=0, reason="ok")
            for h in ("node1", "node3", "node4")
        ),
    ]
    if requeued:
        lines.append(e(30.3, "job_requeued", "node1", cause="preempted", slurm_job="42"))
    if verdicts:  # every node's launcher writes each verdict (node2's died with it)
        lines += [culprit(10.5 + 0.01 * i, h, "round1", "rank failed", 3, 10.1, "SIGKILL")
                  for i, h in enumerate(three)]  # fmt: skip
        lines += [culprit(20.2, h, "round2", "node lost", None, 19.5, "connection_reset")
                  for h in ("node1", "node3")]  # fmt: skip
    return sorted(lines, key=lambda x: x["time"])


def _events(tmp_path: Path, **kw: bool) -> list[Any]:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in _log(**kw)))
    evs, problems = load_events(path)
    assert not problems
    return evs


def _segments(layout: Any, node: str, slot: int) -> list[tuple[int, int, str, bool]]:
    (lane,) = [x for x in layout.lanes if (x.node, x.local_rank) == (node, slot)]
    return [(s.rank, s.generation, s.outcome, s.culprit) for s in lane.segments]


@pytest.mark.parametrize("verdicts", [True, False], ids=["fault_culprit", "older log"])
def test_lanes_by_node_marks_across_them_and_each_faults_culprit(tmp_path, verdicts):
    evs = _events(tmp_path, verdicts=verdicts)
    assert is_multinode(evs)
    layout = node_layout(evs)
    # a band per node in node order (the spare after the nodes before its round), each
    # with a lane per worker seat, labelled by the global rank that ran there
    assert [g.node for g in layout.groups] == ["node1", "node2", "node3", "node4"]
    assert [[x.label for x in g.lanes] for g in layout.groups] == [
        ["rank 0", "rank 1"], ["rank 2", "rank 3"], ["rank 4", "rank 5"], ["rank 2", "rank 3"],
    ]  # fmt: skip
    ys = [x.y for x in layout.lanes]
    assert ys == sorted(ys, reverse=True) and len(set(ys)) == 8  # top down, none shared
    gaps = [a - b for a, b in itertools.pairwise(ys)]
    assert gaps == [1.0, 1.5, 1.0, 1.5, 1.0, 1.5, 1.0]  # the nodes apart, their lanes close
    # the culprits: rank 3 of node2 in round 1, node2 as a whole in round 2
    first, second = layout.culprits
    assert (first.what, first.node, first.rank, first.cause) == (
        "rank failed", "node2", 3, "SIGKILL",
    )  # fmt: skip
    assert first.time == pytest.approx(10.1)  # its exit, not the launcher's detection
    assert first.generation == 1 and first.from_verdict is verdicts
    assert [(x.node, x.local_rank) for x in first.lanes] == [("node2", 1)]
    assert first.label == "node2 rank 3 failed (SIGKILL)"
    assert (second.what, second.node, second.rank, second.generation) == (
        "node lost", "node2", None, 2,
    )  # fmt: skip
    assert second.time == pytest.approx(19.5)  # the last sign of life, not its detection
    assert [(x.node, x.local_rank) for x in second.lanes] == [("node2", 0), ("node2", 1)]
    assert second.label == "node2 lost (connection_reset)"
    # the culprit's segment highlighted; whoever went down after it drawn plainly, node1's
    # rank 1 too, that failed on its own once its peer had gone
    assert _segments(layout, "node2", 1) == [(3, 1, "failed", True), (3, 2, "lost", True)]
    assert _segments(layout, "node2", 0) == [(2, 1, "after fault", False), (2, 2, "lost", True)]
    assert _segments(layout, "node1", 1) == [
        (1, 1, "after fault", False), (1, 2, "after fault", False),
        (1, 3, "stopped", False), (1, 4, "succeeded", False),
    ]  # fmt: skip
    assert _segments(layout, "node4", 0) == [(2, 3, "stopped", False), (2, 4, "succeeded", False)]
    # across every lane: node2 lost (its detection, once though two nodes saw it), node4
    # joining in its place, the requeue
    assert [(m.what, m.label) for m in layout.marks] == [
        ("node lost", "node2 lost"), ("node joined", "node4 joins for node2"),
        ("requeue", "requeue (preempted)"),
    ]  # fmt: skip
    assert [m.time for m in layout.marks] == pytest.approx([20.0, 21.0, 30.3])
    assert [m.tier for m in layout.marks] == [0, 1, 0]  # labels 1 s apart stack
    # the launchers' lives: node2's until its loss, node1's two (before and after the requeue)
    lives = {g.node: g.launchers for g in layout.groups}
    assert lives["node2"] == [pytest.approx((0.1, 19.5))]
    assert lives["node1"] == [pytest.approx((0.0, 30.5)), pytest.approx((60.0, 70.5))]
    pytest.importorskip("matplotlib")
    out = plot_timeline(evs, tmp_path / "timeline.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_restart_without_a_requeue_event_is_marked_where_the_launchers_start_again(tmp_path):
    layout = node_layout(_events(tmp_path, requeued=False))
    assert [(m.what, m.label) for m in layout.marks][-1] == ("requeue", "the job starts again")
    assert layout.marks[-1].time == pytest.approx(60.0)


def test_a_rank_renumbered_by_a_new_round_stays_on_its_nodes_seat(tmp_path):
    """An elastic round without node2: node3's seats run ranks 2 and 3 instead of 4 and 5;
    the lanes stay node3's (labelled with both ranks), no lane of rank 4 elsewhere."""
    three = ("node1", "node2", "node3")
    lines = [
        *(e(0.1 * i, "launcher_start", h, nnodes="2:3") for i, h in enumerate(three)),
        *(started(2.0 + 0.1 * i, h, 1) for i, h in enumerate(three)),
        e(10.0, "node_lost", "node1", cause="silent", node="node2", latency=2.0),
        exited(10.3, "node1", 1, "stopped", [-15, -15]),
        exited(10.3, "node3", 1, "stopped", [-15, -15]),
        e(
            12.0,
            "workers_started",
            "node1",
            generation=2,
            restart_count=1,
            node_rank=0,
            nodes=2,
            world_size=4,
            ranks=[0, 1],
            pids=[200, 201],
        ),
        e(
            12.1,
            "workers_started",
            "node3",
            generation=2,
            restart_count=1,
            node_rank=1,
            nodes=2,
            world_size=4,
            ranks=[2, 3],
            pids=[300, 301],
        ),
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    evs, _ = load_events(path)
    layout = node_layout(evs)
    assert [(x.node, x.label) for x in layout.lanes] == [
        ("node1", "rank 0"), ("node1", "rank 1"), ("node2", "rank 2"), ("node2", "rank 3"),
        ("node3", "ranks 4 > 2"), ("node3", "ranks 5 > 3"),
    ]  # fmt: skip
    assert _segments(layout, "node3", 0) == [(4, 1, "after fault", False), (2, 2, "running", False)]
    (only,) = layout.culprits
    assert (only.what, only.node, only.time) == ("node lost", "node2", pytest.approx(8.0))


def test_a_one_node_run_keeps_its_own_picture(tmp_path):
    lines = [e(0.0, "launcher_start", "vm"), started(1.0, "node1", 1)]
    lines[1]["host"] = "vm"
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    evs, _ = load_events(path)
    assert not is_multinode(evs)
