"""The judgment of one check: the fingerprints of a group's replicas at one step, agreed
or not, and if not, who is the odd one out.

With three replicas or more, the fingerprint a strict majority holds is the state they
all should hold, and every rank with another is a culprit (one corrupted replica among
many: the odd one out). With two, or without a strict majority, nothing tells which side
is wrong: the verdict names every rank that disagrees, the pair, and leaves the rest to
the node ledger's history and the next run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

__all__ = ["Judgment", "judge"]


@dataclass(frozen=True)
class Judgment:
    """``agreed``, or ``culprits`` (global ranks) with how they were found:
    ``odd_one_out`` (a strict majority agreed on another fingerprint) or ``pair`` (two
    replicas, or no majority: ``culprits`` are all the ranks in doubt)."""

    agreed: bool
    culprits: tuple[int, ...] = ()
    how: str = ""
    majority: Hashable = None  # the fingerprint the majority holds


def judge(fingerprints: Mapping[int, Hashable]) -> Judgment:
    """The judgment of ``fingerprints`` (global rank -> fingerprint, one check)."""
    counts = Counter(fingerprints.values())
    if len(counts) <= 1:
        return Judgment(True)
    value, held = counts.most_common(1)[0]
    if len(fingerprints) >= 3 and held * 2 > len(fingerprints):
        odd = tuple(sorted(r for r, fp in fingerprints.items() if fp != value))
        return Judgment(False, odd, "odd_one_out", value)
    return Judgment(False, tuple(sorted(fingerprints)), "pair")
