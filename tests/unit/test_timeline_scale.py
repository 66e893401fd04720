"""The timeline stays readable from 2 ranks to 1,024 (issue 41): a synthetic log of what
the launchers and ranks of 128 nodes x 8 ranks write (a straggler report naming ranks
100 and 900, rank 613 on node77 killed and agreed the culprit, a restart, the end),
laid out and drawn. The layout is checked (the lanes folded by node and across nodes,
the culprit's and the stragglers' lanes drawn out); the picture was looked at (see
docs/architecture.md). A demo-sized run keeps its lane per rank, each detection on the
lane of the rank it names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from steadfast.report import load_events, plot_timeline
from steadfast.report.timeline import detections
from steadfast.report.timeline_fold import MAX_LANES, fold
from steadfast.report.timeline_nodes import node_layout

T0 = 1000.0
NODES, PER_NODE = 128, 8


def e(t: float, kind: str, host: str, rank: int | None = None, **fields: Any) -> dict[str, Any]:
    return {"time": T0 + t, "kind": kind, "rank": rank, "step": fields.pop("step", None),
            "cause": fields.pop("cause", None), "host": host, "pid": 7, "restart": 0,
            **fields}  # fmt: skip


def _seats(n: int) -> list[int]:
    return list(range(n * PER_NODE, (n + 1) * PER_NODE))


def _log() -> list[dict[str, Any]]:
    hosts = [f"node{n + 1}" for n in range(NODES)]
    out: list[dict[str, Any]] = []
    for gen, (start, stop) in enumerate(((1.0, 40.0), (45.0, 70.0)), 1):
        for n, host in enumerate(hosts):
            if gen == 1:
                out.append(e(0.01 * n / NODES, "launcher_start", host, nnodes=str(NODES)))
            ranks = _seats(n)
            out.append(e(start, "workers_started", host, generation=gen, restart_count=gen - 1,
                         node_rank=n, nodes=NODES, world_size=NODES * PER_NODE, ranks=ranks,
                         pids=[100 * gen + r for r in ranks]))  # fmt: skip
            for step in range(int(start) + 1, int(stop), 3):
                for r in ranks[:2]:  # the first two ranks of a node report their steps
                    out.append(e(step, "step_done", host, r, step=step, seconds=0.5))
            ok = gen == 2
            exits = [{"rank": r, "local_rank": i, "pid": 100 * gen + r,
                      "exit_code": 0 if ok else (-9 if r == 613 else -15), "signal": None,
                      "time": T0 + stop} for i, r in enumerate(ranks)]  # fmt: skip
            out.append(e(stop + 0.1, "workers_exited", host,
                         cause="succeeded" if ok else ("failed" if n == 76 else "stopped"),
                         generation=gen, exits=exits, seconds=stop - start))  # fmt: skip
    out.append(e(30.0, "straggler_detected", "node1", 0, ranks=[100, 900], relative=[100, 900],
                 individual=[], scores={"100": 0.5, "900": 0.6}))  # fmt: skip
    out.append(e(39.9, "rank_failed", "node77", 613, cause="signal SIGKILL", exit_code=-9))
    for host in hosts[:3]:  # every node writes the verdict; three are enough here
        out.append(e(40.2, "fault_culprit", host, cause="signal SIGKILL", fault_id="f1",
                     what="rank failed", node="node77", node_rank=76, culprit_rank=613,
                     fault_time=T0 + 39.9, claims=1, stopped=[]))  # fmt: skip
    out.append(e(41.0, "restart", "node1", cause="worker_failure", restart_count=1,
                 reason="r", remaining_restarts=2))  # fmt: skip
    out += [e(70.5, "launcher_end", h, exit_code=0, reason="ok") for h in hosts]
    return sorted(out, key=lambda x: x["time"])


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    path = tmp_path_factory.mktemp("scale") / "events.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in _log()))
    evs, problems = load_events(path)
    assert not problems
    return evs


def test_1024_ranks_are_folded_to_a_readable_picture_with_the_culprit_drawn_out(
    big: list[Any], tmp_path: Path
) -> None:
    stragglers = {r for _, r in detections(big, kinds={"straggler_detected"})}
    assert stragglers == {100, 900}
    full = node_layout(big)
    assert len(full.lanes) == NODES * PER_NODE
    layout = fold(full, stragglers)
    labels = [lane.label for lane in layout.lanes]
    assert len(labels) <= MAX_LANES, labels
    assert "rank 613" in labels and "rank 100" in labels and "rank 900" in labels
    (culprit,) = [lane for lane in layout.lanes if lane.label == "rank 613"]
    assert any(s.culprit for s in culprit.segments)
    # every rank is accounted for: drawn out, or in a folded lane's count
    stood = set()
    for lane in layout.lanes:
        stood |= set(lane.folded or lane.ranks)
    assert stood == set(range(NODES * PER_NODE))
    names = [g.node for g in layout.groups]
    assert "node77" in names and "node13" in names and "node113" in names  # 100, 900's
    assert any("nodes)" in n for n in names)  # the quiet ones, banded
    picture = plot_timeline(big, tmp_path / "timeline-1024.png")
    from PIL import Image

    with Image.open(picture) as img:
        width, height = img.size
    assert height < 3000 and width < 3000, (width, height)  # a screen's picture, not a wall


def test_a_small_run_keeps_a_lane_per_seat() -> None:
    small = [x for x in _log() if x["host"] in ("node1", "node2")]
    from steadfast.events import parse_event

    evs = [parse_event(json.dumps(x)) for x in small]
    layout = fold(node_layout(evs), set())
    assert len(layout.lanes) == 2 * PER_NODE
    assert all(lane.title is None for lane in layout.lanes)


def test_a_detection_is_drawn_on_the_rank_it_names() -> None:
    """A straggler report is rank 0's, naming rank 1; a hang's ranks all overstay their
    timeouts, the culprit confirmed: one mark, on the culprit's lane."""
    from steadfast.events import parse_event

    raw = [
        e(10.0, "straggler_detected", "n1", 0, ranks=[1], relative=[1], individual=[],
          scores={"1": 0.4}),
        e(20.0, "hang_confirmed", "n1", None, cause="no_progress", culprit=1, where="w"),
        e(20.1, "rank_hung", "n1", 0, cause="heartbeat"),
        e(20.2, "rank_hung", "n1", 1, cause="heartbeat"),
        e(30.0, "nan_detected", "n1", 0),
    ]  # fmt: skip
    evs = [parse_event(json.dumps(x)) for x in raw]
    assert [(round(t - T0, 3), r) for t, r in detections(evs)] == [(10.0, 1), (20.1, 1), (30.0, 0)]
