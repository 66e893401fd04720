"""Performance scores (NVRx's definitions; DESIGN.md "Reference behaviour").

A rank's score for a section is ``reference / median time of the section on that rank``
(over a report's scoring window: the samples since the previous report, at least 3 of
them spanning 0.25 s, :mod:`.detector`), in (0, 1], 1 being the best:

- *relative*: the reference is the minimum over ranks of their medians, so the fastest
  rank scores 1 and a rank twice as slow scores 0.5;
- *individual*: the reference is this rank's own best (minimum) median seen so far, so a
  rank that slowed down since its best period scores below 1 even if all ranks slowed.

Below a threshold (0.7 by default) a rank is a straggler.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["StragglerId", "individual_scores", "relative_scores"]


@dataclass(frozen=True, order=True)
class StragglerId:
    """A straggling rank and the node it runs on."""

    rank: int
    node: str


def relative_scores(medians: Mapping[int, float]) -> dict[int, float]:
    """``{rank: min_median / median}`` over the ranks with a positive median."""
    valid = {r: m for r, m in medians.items() if m > 0 and math.isfinite(m)}
    if not valid:
        return {}
    best = min(valid.values())
    return {r: best / m for r, m in valid.items()}


def individual_scores(
    medians: Mapping[int, float], best_so_far: Mapping[int, float]
) -> tuple[dict[int, float], dict[int, float]]:
    """``({rank: best / median}, updated best)``: each rank against its own best median
    (this period's median counts: a rank at its best scores 1)."""
    scores: dict[int, float] = {}
    best = dict(best_so_far)
    for rank, median in medians.items():
        if not (median > 0 and math.isfinite(median)):
            continue
        best[rank] = min(best.get(rank, math.inf), median)
        scores[rank] = best[rank] / median
    return scores, best
