"""The multi-node timeline kept readable from 2 ranks to 1,024 (issue 41): past
:data:`MAX_LANES` lanes, the lanes that tell nothing of their own are folded.

- **Drawn out**: every lane with a fault's culprit on it, an injected fault, or a rank
  the straggler detection named: each keeps a lane of its own, under its node.
- **Folded by node**: a node's other lanes become one, labelled with the ranks it
  stands for (``ranks 8-15 (8)``), drawn as the first of them ran (a node's ranks start,
  step and stop together).
- **Folded across nodes**: where even one lane per node is too many, a run of nodes
  with nothing drawn out becomes one band (``node3 ... node60 (58 nodes)``).

:func:`fold` is pure, as :func:`.timeline_nodes.node_layout` is: tests check what is
drawn without reading pixels.
"""

from __future__ import annotations

from dataclasses import replace

from .timeline_nodes import _GAP, Lane, NodeGroup, NodeLayout

__all__ = ["MAX_LANES", "fold"]

#: the most lanes drawn (a taller picture is not read)
MAX_LANES = 48


def _stands_for(lanes: list[Lane]) -> list[int]:
    return sorted({r for lane in lanes for r in (lane.folded or lane.ranks)})


def _ranks_label(lanes: list[Lane]) -> str:
    ranks = _stands_for(lanes)
    if not ranks:
        return f"{len(lanes)} seats"
    span = (
        f"{ranks[0]}-{ranks[-1]}"
        if ranks[-1] - ranks[0] + 1 == len(ranks)
        else (f"{ranks[0]}...{ranks[-1]}")
    )
    return f"ranks {span} ({len(ranks)})"


def _notable(lane: Lane, stragglers: set[int]) -> bool:
    return (
        any(s.culprit for s in lane.segments)
        or bool(lane.injected)
        or bool(stragglers & set(lane.ranks))
    )


def _folded(lanes: list[Lane], label: str) -> Lane:
    """``lanes`` as one: the first one's life, labelled with all they stand for."""
    first = lanes[0]
    return replace(first, segments=list(first.segments), steps=list(first.steps),
                   saves=list(first.saves), injected=[], title=label,
                   folded=_stands_for(lanes))  # fmt: skip


def fold(layout: NodeLayout, stragglers: set[int], max_lanes: int = MAX_LANES) -> NodeLayout:
    """``layout`` with at most about ``max_lanes`` lanes (see the module's description);
    unchanged when it has no more."""
    if len(layout.lanes) <= max_lanes:
        return layout
    groups: list[NodeGroup] = []
    for g in layout.groups:
        kept = [lane for lane in g.lanes if _notable(lane, stragglers)]
        rest = [lane for lane in g.lanes if not _notable(lane, stragglers)]
        lanes = kept + ([_folded(rest, _ranks_label(rest))] if rest else [])
        groups.append(NodeGroup(g.node, lanes, list(g.launchers)))
    if sum(len(g.lanes) for g in groups) > max_lanes:
        groups = _fold_nodes(groups, stragglers)
    y = 0.0
    for g in groups:
        for lane in g.lanes:
            lane.y, y = y, y - 1.0
        y -= _GAP
    return NodeLayout(layout.t0, layout.end, groups, layout.marks, layout.culprits)


def _fold_nodes(groups: list[NodeGroup], stragglers: set[int]) -> list[NodeGroup]:
    """Runs of nodes with nothing drawn out, each as one band."""
    out: list[NodeGroup] = []
    run: list[NodeGroup] = []

    def close_run() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            name = f"{run[0].node} ... {run[-1].node} ({len(run)} nodes)"
            lanes = [lane for g in run for lane in g.lanes]
            out.append(NodeGroup(name, [_folded(lanes, _ranks_label(lanes))],
                                 list(run[0].launchers)))  # fmt: skip
        run.clear()

    for g in groups:
        if any(_notable(lane, stragglers) for lane in g.lanes):
            close_run()
            out.append(g)
        else:
            run.append(g)
    close_run()
    return out
