"""Rank assignment and rank filters: who is rank what, and who runs, after a restart.

A :class:`RankAssignment` maps the state of the previous iteration, with the ranks that
were terminated since (``state.terminated``, initial ranks), to the ranks and world size
of the next one. A :class:`RankFilter` then decides which of those ranks are *active*
(call the wrapped function); inactive ranks wait as spares. Every rank runs the same
deterministic computation on the same inputs, so all agree without communicating.
Hooks compose with :class:`~steadfast.inprocess.Compose` (``Compose(a, b)(s) ==
a(b(s))``, as in NVRx) or ``a | b`` (``a`` first, then ``b``).

Every class here also takes NVRx's calling convention, a :class:`RankAssignmentCtx`
``(state, store, terminated_ranks)`` with this rank's *current* rank and the current
ranks terminated: it returns the ctx with this rank's new state and no terminated ranks
left, or raises :class:`RankDiscarded` for a terminated rank. The Wrapper itself calls
them with a :class:`State` (every rank computes every rank's assignment, so all agree
and reassignments are reported); a custom rank assignment for the Wrapper takes a
:class:`State` too. NVRx 0.4.1's ``Tree`` / ``Layer`` assignments are not provided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .state import Mode, RestartAbort, RestartError, State

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
]


class RankDiscarded(RestartError):
    """This rank was terminated: a rank assignment has no rank for it (NVRx)."""


@dataclass
class RankAssignmentCtx:
    """NVRx's input and output of a rank assignment: this rank's ``state`` (its current
    rank and world size), the restart ``store``, and the current ranks terminated."""

    state: State
    store: Any
    terminated_ranks: set[int]


class RankAssignment:
    """Base class: ``__call__(state) -> state`` computes the next ranks and world size
    (or NVRx's ``__call__(ctx) -> ctx``, see the module docstring)."""

    def __call__(self, state: Any) -> Any:
        if isinstance(state, RankAssignmentCtx):
            return self.assign_ctx(state)
        return self.assign(state)

    def assign(self, state: State) -> State:
        """The new state of every rank (the Wrapper's convention)."""
        raise NotImplementedError

    def assign_ctx(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """This rank's new state, from its current rank and the terminated ones (NVRx)."""
        raise NotImplementedError(f"{type(self).__name__} takes a State, not a RankAssignmentCtx")

    def __or__(self, other: RankAssignment) -> RankAssignment:
        from .compose import Compose

        chained: RankAssignment = Compose(other, self)  # type: ignore[assignment]
        return chained


def _moved(ctx: RankAssignmentCtx, rank: int, world_size: int) -> RankAssignmentCtx:
    ctx.state = ctx.state.replace(rank=rank, world_size=world_size)
    ctx.terminated_ranks = set()
    return ctx


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
        mode=Mode.ACTIVE if rank >= 0 else Mode.TERMINATED,
    )


class ShiftRanks(RankAssignment):
    """Close the gaps left by terminated ranks: each rank moves down by the number of
    terminated ranks below it (order is kept; world size shrinks by the number lost)."""

    def assign(self, state: State) -> State:
        assignment = [-1] * state.initial_world_size
        for new, r in enumerate(_alive_by_rank(state)):
            assignment[r] = new
        return _with_assignment(state, assignment)

    def assign_ctx(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, gone = ctx.state.rank, ctx.terminated_ranks
        if rank in gone:
            raise RankDiscarded(f"rank={rank} terminated_ranks={sorted(gone)}")
        return _moved(
            ctx, rank - sum(1 for t in gone if t < rank), ctx.state.world_size - len(gone)
        )


def _gap_moves(world: int, terminated: set[int]) -> dict[int, int]:
    """FillGaps' moves: the ranks past the new world size, in order, into the holes
    below it, in order; every other rank keeps its rank."""
    new_world = world - len(terminated)
    holes = sorted(t for t in terminated if t < new_world)
    movers = [r for r in range(new_world, world) if r not in terminated]
    return dict(zip(movers, holes, strict=True))


class FillGaps(RankAssignment):
    """Fill the holes left by terminated ranks with the ranks past the new world size
    (in order, lowest hole first): every other rank keeps its rank, so fewer ranks
    change and less state has to move. (NVRx 0.4.1's FillGaps can give a rank past the
    new world size when a terminated rank lies beyond it, unlike its own documentation;
    steadfast fills the holes as documented.)"""

    def assign(self, state: State) -> State:
        alive = _alive_by_rank(state)
        current = [state.assignment[r] for r in alive]
        terminated = set(range(state.world_size)) - set(current)
        moves = _gap_moves(state.world_size, terminated)
        assignment = [-1] * state.initial_world_size
        for r, cur in zip(alive, current, strict=True):
            assignment[r] = moves.get(cur, cur)
        return _with_assignment(state, assignment)

    def assign_ctx(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, gone, world = ctx.state.rank, set(ctx.terminated_ranks), ctx.state.world_size
        if rank in gone:
            raise RankDiscarded(f"rank={rank} terminated_ranks={sorted(gone)}")
        return _moved(ctx, _gap_moves(world, gone).get(rank, rank), world - len(gone))


class RankFilter(RankAssignment):
    """Base class of filters: keep ranks and world size, decide who is active. Filters
    compose: each caps the active world size the one before left."""

    def active_world_size(self, state: State) -> int:
        raise NotImplementedError

    def _filtered(self, state: State) -> State:
        active_world = max(0, min(self.active_world_size(state), state.world_size))
        active = state.rank if 0 <= state.rank < active_world else None
        mode = Mode.ACTIVE if active is not None else Mode.INACTIVE
        return state.replace(active_rank=active, active_world_size=active_world, mode=mode)

    def assign(self, state: State) -> State:
        new = self._filtered(state)
        if not new.active_world_size:
            raise RestartAbort(
                f"{type(self).__name__} leaves no active rank (world size {state.world_size})"
            )
        return new

    def assign_ctx(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        ctx.state = self._filtered(ctx.state)
        return ctx


def _so_far(state: State) -> int:
    """The active world size left by the filters before (the world size if none)."""
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


class ActivateAllRanks(RankFilter):
    """Every rank is active (the default when no rank filter is given)."""

    def active_world_size(self, state: State) -> int:
        return state.world_size


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active (None: no limit); the rest
    wait as spares."""

    def __init__(self, max_active_world_size: int | None = None) -> None:
        if max_active_world_size is not None and max_active_world_size < 1:
            raise ValueError(f"max_active_world_size must be >= 1, got {max_active_world_size}")
        self.max_active_world_size = max_active_world_size

    def active_world_size(self, state: State) -> int:
        limit = self.max_active_world_size
        return _so_far(state) if limit is None else min(_so_far(state), limit)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The active world size is the largest multiple of ``divisor`` that fits (e.g. the
    data-parallel size times the model-parallel size); leftover ranks are spares."""

    def __init__(self, divisor: int = 1) -> None:
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        self.divisor = divisor

    def active_world_size(self, state: State) -> int:
        return _so_far(state) // self.divisor * self.divisor
