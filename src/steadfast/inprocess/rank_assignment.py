"""Rank assignment and rank filters: who is rank what, and who runs, after a restart.

A :class:`RankAssignment` maps the state of the previous iteration, with the ranks that
were terminated since (``state.terminated``, initial ranks), to the ranks and world size
of the next one. A :class:`RankFilter` then decides which of those ranks are *active*
(call the wrapped function); inactive ranks wait as spares. Every rank runs the same
deterministic computation on the same inputs, so all agree without communicating.
Hooks compose with :class:`~steadfast.inprocess.Compose` (``Compose(a, b)(s) ==
a(b(s))``, as in NVRx) or ``a | b`` (``a`` first, then ``b``).
"""

from __future__ import annotations

from .state import RestartAbort, State

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankFilter",
    "ShiftRanks",
]


class RankAssignment:
    """Base class: ``__call__(state) -> state`` computes the next ranks and world size."""

    def __call__(self, state: State) -> State:
        raise NotImplementedError

    def __or__(self, other: RankAssignment) -> RankAssignment:
        from .compose import Compose

        chained: RankAssignment = Compose(other, self)  # type: ignore[assignment]
        return chained


def _alive_by_rank(state: State) -> list[int]:
    """Initial ranks still alive, ordered by their current rank."""
    alive = [r for r, cur in enumerate(state.assignment) if cur >= 0 and r not in state.terminated]
    return sorted(alive, key=lambda r: state.assignment[r])


def _with_assignment(state: State, assignment: list[int]) -> State:
    rank = assignment[state.initial_rank]
    world = sum(1 for cur in assignment if cur >= 0)
    if world == 0:
        raise RestartAbort("rank assignment left no rank alive")
    return state.replace(
        assignment=tuple(assignment),
        rank=rank,
        world_size=world,
        active_rank=rank if rank >= 0 else None,
        active_world_size=world,
    )


class ShiftRanks(RankAssignment):
    """Close the gaps left by terminated ranks: each rank moves down by the number of
    terminated ranks below it (order is kept; world size shrinks by the number lost)."""

    def __call__(self, state: State) -> State:
        assignment = [-1] * state.initial_world_size
        for new, r in enumerate(_alive_by_rank(state)):
            assignment[r] = new
        return _with_assignment(state, assignment)


class FillGaps(RankAssignment):
    """Fill the holes left by terminated ranks with the highest ranks: every other rank
    keeps its rank (fewer ranks change, so less state has to move)."""

    def __call__(self, state: State) -> State:
        alive = _alive_by_rank(state)
        world = len(alive)
        assignment = [-1] * state.initial_world_size
        taken = set()
        movers = []
        for r in alive:
            cur = state.assignment[r]
            if cur < world:
                assignment[r] = cur
                taken.add(cur)
            else:
                movers.append(r)
        holes = [h for h in range(world) if h not in taken]
        for r, hole in zip(sorted(movers, key=lambda r: -state.assignment[r]), holes, strict=True):
            assignment[r] = hole
        return _with_assignment(state, assignment)


class RankFilter(RankAssignment):
    """Base class of filters: keep ranks and world size, decide who is active."""

    def active_world_size(self, state: State) -> int:
        raise NotImplementedError

    def __call__(self, state: State) -> State:
        active_world = min(self.active_world_size(state), state.world_size)
        if active_world < 1:
            raise RestartAbort(
                f"{type(self).__name__} leaves no active rank (world size {state.world_size})"
            )
        active = state.rank if 0 <= state.rank < active_world else None
        return state.replace(active_rank=active, active_world_size=active_world)


class ActivateAllRanks(RankFilter):
    """Every rank is active (the default when no rank filter is given)."""

    def active_world_size(self, state: State) -> int:
        return state.world_size


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active; the rest wait as spares."""

    def __init__(self, max_active_world_size: int) -> None:
        if max_active_world_size < 1:
            raise ValueError(f"max_active_world_size must be >= 1, got {max_active_world_size}")
        self.max_active_world_size = max_active_world_size

    def active_world_size(self, state: State) -> int:
        return min(state.world_size, self.max_active_world_size)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The active world size is the largest multiple of ``divisor`` that fits (e.g. the
    data-parallel size times the model-parallel size); leftover ranks are spares."""

    def __init__(self, divisor: int = 1) -> None:
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        self.divisor = divisor

    def active_world_size(self, state: State) -> int:
        return state.world_size // self.divisor * self.divisor
