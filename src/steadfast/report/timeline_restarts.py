"""The timeline's restart lane: each restart drawn where it happened as one stacked bar,
from the fault to the first iteration after it, a colour per phase (see
:mod:`.restarts`), its total written beside it. Every timeline layout draws it below its
lowest lane."""

from __future__ import annotations

from typing import Any

from .restarts import PHASES, Restart

__all__ = ["LABEL", "draw_restarts"]

LABEL = "restarts"

#: a colour per phase: the launcher's in greys and purples, the worker's in warm colours
_COLOURS = {
    "detection": "#d62728",
    "stopping": "#ff9896",
    "requeue": "#7f7f7f",
    "health_check": "#c5b0d5",
    "rendezvous": "#9467bd",
    "launcher": "#c7c7c7",
    "process_start": "#8c564b",
    "imports": "#e377c2",
    "init_process_group": "#17becf",
    "setup": "#bcbd22",
    "checkpoint_load": "#2ca02c",
    "first_batch": "#98df8a",
    "compile": "#ff7f0e",
    "first_step": "#1f77b4",
    "inprocess_restart": "#9edae5",
    "inprocess_first_step": "#aec7e8",
}
assert set(_COLOURS) == set(PHASES)


def draw_restarts(ax: Any, restarts: list[Restart], t0: float, y: float) -> list[Any]:
    """Draw ``restarts`` on ``ax`` at lane ``y`` (x: seconds since ``t0``); the legend
    handles of the phases drawn (none without restarts)."""
    from matplotlib.patches import Patch

    used: dict[str, None] = {}
    for r in restarts:
        last = r.last
        x = last.fault_time - t0
        for name, seconds in last.phases.items():
            if seconds <= 0:
                continue
            ax.broken_barh([(x, seconds)], (y - 0.3, 0.6), facecolors=_COLOURS[name],
                           edgecolor="white", linewidth=0.3, zorder=3)  # fmt: skip
            used[name] = None
            x += seconds
        total = "not back" if last.seconds is None else f"{last.seconds:.1f} s"
        ax.annotate(total, (x, y), xytext=(3, 0), textcoords="offset points", va="center",
                    fontsize=7, zorder=4)  # fmt: skip
    return [Patch(color=_COLOURS[name], label=name.replace("_", " ")) for name in used]
