"""The timeline picture: one lane per rank, time on the x axis, showing steps, faults,
detections, restarts and checkpoints (matplotlib, an optional dependency:
``pip install steadfast[report]``). A run whose workers ran on several nodes gets a lane
per worker seat, grouped by node, laid out by :mod:`.timeline_nodes`: each worker's life
per generation, its steps and saves, the lost nodes, spares and requeues across every
lane, and each fault's culprit highlighted. A one-node run whose script reports no steps
gets one lane per node instead, from its launchers' events."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import events as ev
from .goodput import DETECTION_KINDS
from .launchers import as_list
from .restarts import Restart, restarts
from .steps import timed
from .timeline_fold import fold
from .timeline_nodes import (
    CULPRIT,
    MARK_COLOURS,
    OUTCOME_COLOURS,
    NodeLayout,
    is_multinode,
    node_layout,
)
from .timeline_restarts import LABEL, draw_restarts

__all__ = ["detections", "plot_timeline"]

_DETECTIONS = {k for kinds in DETECTION_KINDS.values() for k in kinds} | {
    ev.Kind.NAN_ROLLBACK_RECOMMENDED,
    ev.Kind.ROLLBACK,
}


#: seconds within which the ranks' hang events are one hang (every rank that waited on
#: the culprit overstays its timeout about together)
_SAME_HANG = 30.0


def detections(events: list[ev.Event], kinds: set[str] | None = None) -> list[tuple[float, int]]:
    """Each detection as ``(time, rank)``, at the rank it names: a straggler report's
    stragglers (not the rank that reported them), a hang's culprit once (the
    ``hang_confirmed`` culprit, else the first rank found hung; not every rank that
    stopped waiting on it), else the event's own rank."""
    wanted = _DETECTIONS if kinds is None else kinds
    culprits = [(e.time, e.get("culprit")) for e in events
                if e.kind == ev.Kind.HANG_CONFIRMED and e.get("culprit") is not None]  # fmt: skip
    hangs: list[float] = []
    out: list[tuple[float, int]] = []
    for e in events:
        if e.kind not in wanted:
            continue
        if e.kind == ev.Kind.STRAGGLER_DETECTED:
            named = [r for r in as_list(e.get("ranks")) if isinstance(r, int)]
            out.extend((e.time, r) for r in named)
        elif e.kind == ev.Kind.RANK_HUNG:
            if any(abs(e.time - t) < _SAME_HANG for t in hangs):
                continue
            culprit = next((c for t, c in culprits if abs(t - e.time) < _SAME_HANG), e.rank)
            if isinstance(culprit, int):
                hangs.append(e.time)
                out.append((e.time, culprit))
        elif e.rank is not None:
            out.append((e.time, e.rank))
    return out


def plot_timeline(events: list[ev.Event], path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw ``events`` (sorted by time) to ``path`` (PNG). Raises ImportError with the
    install hint when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the timeline needs matplotlib: pip install 'steadfast[report]'") from exc
    if not events:
        raise ValueError("no events to draw")
    events = timed(sorted(events, key=lambda e: e.time))  # a step without seconds: derived
    found = restarts(events)
    if is_multinode(events):
        slow = detections(events, kinds={ev.Kind.STRAGGLER_DETECTED})
        layout = fold(node_layout(events), {r for _, r in slow})
        return _plot_multinode(plt, layout, Path(path), title, found, slow)
    if not any(e.kind == ev.Kind.STEP_DONE for e in events) and any(
        e.kind == ev.Kind.WORKERS_STARTED for e in events
    ):
        return _plot_nodes(plt, events, Path(path), title, found)
    starts = [e.get("process_start") for e in events if e.kind == ev.Kind.JOB_START]
    t0 = min([events[0].time] + [float(s) for s in starts if s is not None])
    ranks = sorted({e.rank for e in events if e.rank is not None})
    lane = {r: i for i, r in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(12, 2.2 * bool(found) + 1.2 + 0.9 * max(1, len(ranks))))
    try:
        for r in ranks:
            mine = [e for e in events if e.rank == r]
            y = lane[r]
            bars = [
                (e.time - t0 - float(e.get("seconds") or 0.0), float(e.get("seconds") or 0.0))
                for e in mine
                if e.kind == ev.Kind.STEP_DONE
            ]
            ax.broken_barh(bars, (y - 0.3, 0.6), facecolors="tab:blue", alpha=0.55)
            saves = [
                (e.time - t0 - float(e.get("seconds") or 0.0), float(e.get("seconds") or 0.0))
                for e in mine
                if e.kind == ev.Kind.CHECKPOINT_SAVED
            ]
            ax.broken_barh(saves, (y - 0.4, 0.8), facecolors="tab:green")
            for e in mine:
                x = e.time - t0
                if e.kind == ev.Kind.FAULT_INJECTED:
                    ax.plot(x, y + 0.45, "X", color="red", markersize=11)
                    ax.annotate(str(e.get("fault") or e.cause), (x, y + 0.5), fontsize=7,
                                color="red", rotation=25)  # fmt: skip
                elif e.kind == ev.Kind.JOB_START:  # the process began earlier: start-up time
                    began = e.get("process_start")
                    began = x if began is None else float(began) - t0
                    ax.plot(began, y, ">", color="black", markersize=7)
                    ax.plot([began, x], [y, y], color="gray", linewidth=2)
        for at, r in detections(events):  # on the lane of the rank each names
            if r in lane:
                ax.plot(at - t0, lane[r] - 0.45, "^", color="darkorange", markersize=9)
        for e in events:
            if e.kind == ev.Kind.FAULT_INJECTED and e.rank is None:  # from outside (a SIGTERM)
                ax.axvline(e.time - t0, color="red", linestyle=":", linewidth=1)
            if e.kind == ev.Kind.RESTART:
                ax.axvline(e.time - t0, color="purple", linestyle="--", linewidth=1)
        phases = draw_restarts(ax, found, t0, -1)
        ax.set_yticks(range(-1 if found else 0, len(ranks)),
                      [LABEL] * bool(found) + [f"rank {r}" for r in ranks])  # fmt: skip
        ax.set_ylim(-1.8 if found else -0.8, len(ranks) - 0.2 + 0.6)
        ax.set_xlabel("seconds since the first process started")
        ax.set_title(title or "steadfast run timeline", fontsize=10)
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        ax.legend(
            handles=[
                Patch(color="tab:blue", alpha=0.55, label="step"),
                Patch(color="tab:green", label="checkpoint save"),
                Line2D([], [], marker="X", color="red", linestyle="", label="fault injected"),
                Line2D([], [], marker="^", color="darkorange", linestyle="", label="detected"),
                Line2D(
                    [], [], marker=">", color="black", linestyle="", label="process start, start-up"
                ),
                Line2D([], [], color="purple", linestyle="--", label="in-job restart"),
                *phases,
            ],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=6,
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        return out
    finally:
        plt.close(fig)


_NODE_OUTCOME_COLOURS = {"succeeded": "tab:blue", "stopped": "tab:gray", "failed": "tab:red"}


def _plot_nodes(
    plt: Any, events: list[ev.Event], out: Path, title: str, found: list[Restart]
) -> Path:
    """One lane per node, from the launchers' events (a script that reports no steps)."""
    t0 = min(e.time for e in events)
    nodes = list(
        dict.fromkeys(
            str(e.get("host"))
            for e in events
            if e.kind in (ev.Kind.LAUNCHER_START, ev.Kind.WORKERS_STARTED) and e.get("host")
        )
    )
    nodes.sort()  # node1 at the top
    lane = {n: len(nodes) - 1 - i for i, n in enumerate(nodes)}
    lost_at = {  # a node lost with its workers: they ran until the loss began
        str(e.get("node")): e.time - float(e.get("latency") or 0.0) - t0
        for e in events
        if e.kind == ev.Kind.NODE_LOST
    }
    fig, ax = plt.subplots(figsize=(12, 2.2 * bool(found) + 1.4 + 0.8 * max(1, len(nodes))))
    try:
        started: dict[tuple[str, int], float] = {}
        open_bars: dict[tuple[str, int], float] = {}  # started, never seen to exit
        for e in events:
            host = str(e.get("host"))
            if host not in lane:
                continue
            y, x = lane[host], e.time - t0
            if e.kind in (ev.Kind.WORKERS_STARTED, ev.Kind.WORKERS_EXITED):
                key = (host, int(e.get("generation") or 0))
            if e.kind == ev.Kind.WORKERS_STARTED:
                started[key] = x
                open_bars[key] = x
            elif e.kind == ev.Kind.WORKERS_EXITED and key in started:
                exits = [
                    float(w["time"]) - t0
                    for w in as_list(e.get("exits"))
                    if isinstance(w, dict) and w.get("time")
                ]
                end = max(exits) if exits else x
                open_bars.pop(key, None)
                colour = _NODE_OUTCOME_COLOURS.get(str(e.cause), "tab:gray")
                ax.broken_barh(
                    [(started[key], end - started[key])], (y - 0.3, 0.6), facecolors=colour,
                    alpha=0.6,
                )  # fmt: skip
            elif e.kind == ev.Kind.LAUNCHER_START:
                ax.plot(x, y, ">", color="black", markersize=7)
            elif e.kind == ev.Kind.LAUNCHER_END:
                ax.plot(x, y, "|", color="black", markersize=14, markeredgewidth=2)
            elif e.kind in (
                ev.Kind.RANK_FAILED,
                ev.Kind.RANK_HUNG,
                ev.Kind.NODE_UNHEALTHY,
                ev.Kind.NODE_ISOLATED,
            ):
                ax.plot(x, y + 0.42, "^", color="darkorange", markersize=9)
        for (host, _), x in open_bars.items():
            end = lost_at.get(host, events[-1].time - t0)
            ax.broken_barh([(x, end - x)], (lane[host] - 0.3, 0.6), facecolors="tab:red",
                           alpha=0.35)  # fmt: skip
        for e in events:
            x = e.time - t0
            if e.kind == ev.Kind.NODE_LOST:
                node = str(e.get("node"))
                latency = float(e.get("latency") or 0.0)
                ax.axvline(x, color="red", linestyle="--", linewidth=1)
                if node in lane:
                    ax.plot(x - latency, lane[node], "X", color="red", markersize=12)
                    ax.annotate(f"{node} lost ({e.cause})", (x, lane[node] + 0.42),
                                fontsize=7, color="red")  # fmt: skip
            elif e.kind == ev.Kind.NODE_JOINED:
                node = str(e.get("node"))
                if node in lane:
                    ax.plot(x, lane[node], "D", color="green", markersize=8)
                    ax.annotate(f"{node} joins", (x, lane[node] - 0.48), fontsize=7,
                                color="green")  # fmt: skip
        phases = draw_restarts(ax, found, t0, -1)
        ax.set_yticks([-1] * bool(found) + [lane[n] for n in nodes], [LABEL] * bool(found) + nodes)
        ax.set_ylim(-1.8 if found else -0.8, len(nodes) - 0.2 + 0.6)
        ax.set_xlabel("seconds since the first launcher started")
        ax.set_title(title or "steadfast run timeline (by node: the script reports no steps)",
                     fontsize=10)  # fmt: skip
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        ax.legend(
            handles=[
                Patch(color="tab:blue", alpha=0.6, label="workers running (ended well)"),
                Patch(color="tab:gray", alpha=0.6, label="workers stopped"),
                Patch(color="tab:red", alpha=0.6, label="workers failed"),
                Patch(color="tab:red", alpha=0.35, label="workers lost with their node"),
                Line2D([], [], marker="X", color="red", linestyle="", label="node lost"),
                Line2D([], [], color="red", linestyle="--", label="loss detected"),
                Line2D([], [], marker="D", color="green", linestyle="", label="node joined"),
                Line2D([], [], marker=">", color="black", linestyle="", label="launcher start"),
                Line2D([], [], marker="|", color="black", linestyle="", label="launcher end"),
                *phases,
            ],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=5,
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        return out
    finally:
        plt.close(fig)


_OUTCOME_NAMES = {
    "succeeded": "worker ran, ended well",
    "after fault": "worker went down after the fault (not its own)",
    "stopped": "worker stopped, no fault (a preemption, a new round)",
    "failed": "worker failed (no culprit named)",
    "lost": "worker lost with its node",
    "running": "worker: no end recorded",
}

_MARK_NAMES = {
    "node lost": "node lost (its detection)",
    "node joined": "node joined",
    "requeue": "requeue, or the job started again",
}


def _pale(colour: str, alpha: float) -> tuple[float, float, float]:
    """``colour`` at ``alpha`` over white, as an opaque colour."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return (1 - alpha + alpha * r, 1 - alpha + alpha * g, 1 - alpha + alpha * b)


def _plot_multinode(
    plt: Any,
    layout: NodeLayout,
    out: Path,
    title: str,
    found: list[Restart],
    slow: list[tuple[float, int]],
) -> Path:
    """Draw ``layout`` (see :mod:`.timeline_nodes`): a band per node, a lane per seat."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = layout.lanes
    rows = max((m.tier for m in layout.marks), default=-1) + 1
    low, high = min(lane.y for lane in lanes), max(lane.y for lane in lanes)
    low -= bool(found)  # the restarts' lane below the lowest
    top = high + 0.55 + 0.42 * rows
    height = 1.9 + 0.36 * (top - low + 1)
    fig, ax = plt.subplots(figsize=(12, height))
    try:
        steps = any(lane.steps for lane in lanes)
        for i, g in enumerate(layout.groups):
            bottom, upper = g.span
            if i % 2 == 0:
                ax.axhspan(bottom - 0.5, upper + 0.5, color="0.93", zorder=0)
            ax.annotate(g.node, (0, (bottom + upper) / 2), xycoords=("axes fraction", "data"),
                        xytext=(-14 - 5.5 * max(len(x.label) for x in g.lanes), 0),
                        textcoords="offset points", ha="right", va="center", fontsize=10,
                        fontweight="bold")  # fmt: skip
            for lane in g.lanes:
                for start, end in g.launchers:
                    ax.plot([start, end], [lane.y, lane.y], color="0.35", lw=0.8, zorder=1)
                    ax.plot(start, lane.y, ">", color="0.2", markersize=4, zorder=1)
        for lane in lanes:
            for s in lane.segments:
                colour = CULPRIT if s.culprit else OUTCOME_COLOURS.get(s.outcome, "tab:gray")
                # solid (the launcher's line must not show through), light under steps
                face = _pale(colour, 0.9 if s.culprit else (0.3 if steps else 0.55))
                edge = "black" if s.culprit else "white"  # white: two generations apart
                ax.broken_barh([(s.start, s.end - s.start)], (lane.y - 0.32, 0.64), zorder=2,
                               facecolors=face, edgecolor=edge, linewidth=1)  # fmt: skip
                if len(lane.ranks) > 1:  # renumbered: say which rank ran here then
                    ax.text(s.start + 0.01 * layout.end, lane.y, f"r{s.rank}", fontsize=6,
                            va="center", zorder=4)  # fmt: skip
            ax.broken_barh(lane.steps, (lane.y - 0.18, 0.36), facecolors="tab:blue", zorder=3)
            ax.broken_barh(lane.saves, (lane.y - 0.36, 0.72), facecolors="tab:green", zorder=3)
            for x, what in lane.injected:
                ax.plot(x, lane.y + 0.4, "X", color="red", markersize=9, zorder=5)
                ax.annotate(what, (x, lane.y + 0.45), fontsize=7, color="red", zorder=5)
        drawn_out = {r: lane for lane in lanes if lane.title is None for r in lane.ranks}
        for at, rank in slow:  # a straggler, on its own lane
            if rank in drawn_out:
                ax.plot(at - layout.t0, drawn_out[rank].y + 0.42, "v", color="darkorange",
                        markersize=8, zorder=5)  # fmt: skip
        for m in layout.marks:
            colour = MARK_COLOURS[m.what]
            ax.axvline(m.time, color=colour, linestyle="--", linewidth=1.1, zorder=4)
            ax.text(m.time, high + 0.55 + 0.42 * m.tier, m.label, color=colour, fontsize=7,
                    va="center", ha="left", zorder=6,
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"})  # fmt: skip
        for c in layout.culprits:
            ys = [lane.y for lane in c.lanes] or [high]
            y = (min(ys) + max(ys)) / 2
            ax.plot(c.time, y, "*", color="yellow", markeredgecolor="black", markersize=13,
                    zorder=6)  # fmt: skip
            late = c.time > 0.6 * layout.end  # put the label where there is room
            ax.annotate("culprit: " + c.label, (c.time, y), xytext=(-9 if late else 9, 0),
                        textcoords="offset points", ha="right" if late else "left",
                        va="center", fontsize=8, color=CULPRIT, fontweight="bold", zorder=7,
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": CULPRIT,
                              "alpha": 0.9})  # fmt: skip
        handles_phases = draw_restarts(ax, found, layout.t0, low)
        ticks = [(low, LABEL)] * bool(found) + [(lane.y, lane.label) for lane in lanes]
        ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=8)
        ax.set_ylim(low - 0.7, top + 0.3)
        ax.set_xlim(-0.01 * layout.end, layout.end * 1.01)
        ax.set_xlabel("seconds since the first launcher started")
        ax.set_title(title or "steadfast run timeline", fontsize=10)
        used = {s.outcome for lane in lanes for s in lane.segments if not s.culprit}
        handles: list[Any] = [
            Patch(color=_pale(OUTCOME_COLOURS[o], 0.3 if steps else 0.55), label=_OUTCOME_NAMES[o])
            for o in OUTCOME_COLOURS
            if o in used
        ]
        if layout.culprits:
            handles.append(Patch(facecolor=CULPRIT, edgecolor="black", label="a fault's culprit"))
        if steps:
            handles.append(Patch(color="tab:blue", label="step"))
        if any(lane.saves for lane in lanes):
            handles.append(Patch(color="tab:green", label="checkpoint save"))
        if any(rank in drawn_out for _, rank in slow):
            handles.append(Line2D([], [], color="darkorange", marker="v", linestyle="",
                                  label="found a straggler"))  # fmt: skip
        handles.append(Line2D([], [], color="0.35", marker=">", markersize=4, label="launcher"))
        for what in dict.fromkeys(m.what for m in layout.marks):
            handles.append(Line2D([], [], color=MARK_COLOURS[what], linestyle="--",
                                  label=_MARK_NAMES[what]))  # fmt: skip
        handles.extend(handles_phases)
        below = -0.5 / (height - 1.2)  # under the axis' label, however tall the axes
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, below), ncol=4,
                  fontsize=8, frameon=False)  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        return out
    finally:
        plt.close(fig)
