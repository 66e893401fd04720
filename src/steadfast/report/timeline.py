"""The timeline picture: one lane per rank, time on the x axis, showing steps, faults,
detections, restarts and checkpoints (matplotlib, an optional dependency:
``pip install steadfast[report]``)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import events as ev
from .goodput import DETECTION_KINDS

__all__ = ["plot_timeline"]

_DETECTIONS = {k for kinds in DETECTION_KINDS.values() for k in kinds} | {
    "nan_rollback_recommended",
    "rollback",
}


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
    starts = [e.get("process_start") for e in events if e.kind == "job_start"]
    t0 = min([events[0].time] + [float(s) for s in starts if s is not None])
    ranks = sorted({e.rank for e in events if e.rank is not None})
    lane = {r: i for i, r in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * max(1, len(ranks))))
    try:
        for r in ranks:
            mine = [e for e in events if e.rank == r]
            y = lane[r]
            bars = [
                (e.time - t0 - float(e.get("seconds") or 0.0), float(e.get("seconds") or 0.0))
                for e in mine
                if e.kind == "step_done"
            ]
            ax.broken_barh(bars, (y - 0.3, 0.6), facecolors="tab:blue", alpha=0.55)
            saves = [
                (e.time - t0 - float(e.get("seconds") or 0.0), float(e.get("seconds") or 0.0))
                for e in mine
                if e.kind == "checkpoint_saved"
            ]
            ax.broken_barh(saves, (y - 0.4, 0.8), facecolors="tab:green")
            for e in mine:
                x = e.time - t0
                if e.kind == "fault_injected":
                    ax.plot(x, y + 0.45, "X", color="red", markersize=11)
                    ax.annotate(str(e.get("fault") or e.cause), (x, y + 0.5), fontsize=7,
                                color="red", rotation=25)  # fmt: skip
                elif e.kind in _DETECTIONS:
                    ax.plot(x, y - 0.45, "^", color="darkorange", markersize=9)
                elif e.kind == "job_start":  # the process began earlier: start-up time
                    began = e.get("process_start")
                    began = x if began is None else float(began) - t0
                    ax.plot(began, y, ">", color="black", markersize=7)
                    ax.plot([began, x], [y, y], color="gray", linewidth=2)
        for e in events:
            if e.kind == "fault_injected" and e.rank is None:  # from outside (a SIGTERM)
                ax.axvline(e.time - t0, color="red", linestyle=":", linewidth=1)
            if e.kind == "restart":
                ax.axvline(e.time - t0, color="purple", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.set_ylim(-0.8, len(ranks) - 0.2 + 0.6)
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
        fig.savefig(out, dpi=110)
        return out
    finally:
        plt.close(fig)
