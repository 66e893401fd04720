"""Where the ranks of a Wrapper call wait for one another, in the restart store.

- :func:`await_completion`: after the function returned (or on a spare rank), until
  every active rank has returned, or until the iteration is interrupted first.
- :func:`restart_barrier`: between iterations, every rank that is not terminated meets
  the others; they leave with the same set of terminated ranks (the store freezes it).
- :func:`last_call`: a rank that ends the run with an error tells the others, and waits a
  moment for their concurrent terminal failures, to name them in its error.
"""

from __future__ import annotations

import time

from .state import BarrierTimeout, State
from .store import COMPLETED, INTERRUPTED, StoreMixin

__all__ = ["await_completion", "last_call", "restart_barrier"]


def await_completion(store: StoreMixin, state: State, timeout: float) -> bool:
    """After the function returned (or on a spare): True once every active rank has
    returned, False if the iteration was interrupted first. An active rank waits at most
    ``timeout`` seconds (``completion_timeout``), a spare as long as it takes."""
    it = state.iteration
    if state.active:
        store.record_completed(it, state.initial_rank)
    active_world = state.active_world_size or 0
    actives = {r for r, cur in enumerate(state.assignment) if 0 <= cur < active_world}
    deadline = time.monotonic() + (timeout if state.active else float("inf"))
    delay = 0.002
    while True:
        status = store.iteration_state(it)
        if status == INTERRUPTED:
            return False
        if status == COMPLETED or actives <= store.completed(it):
            return store.mark_completed(it) == COMPLETED
        if time.monotonic() > deadline:
            raise BarrierTimeout(
                f"iteration {it}: ranks {sorted(actives - store.completed(it))} did not "
                f"return within completion_timeout"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def restart_barrier(store: StoreMixin, state: State, timeout: float) -> frozenset[int]:
    """Meet every rank that is not terminated after ``state``'s iteration; return the
    terminated set they agree on. Raises :class:`BarrierTimeout` after ``timeout``
    seconds (``barrier_timeout``)."""
    iteration = state.iteration
    rank = state.initial_rank
    everyone = frozenset(range(state.initial_world_size))
    store.arrive(iteration, rank)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        terminated = store.terminated()
        if everyone <= store.arrived(iteration) | terminated:
            return store.freeze(iteration, terminated)
        if time.monotonic() > deadline:
            missing = sorted(everyone - store.arrived(iteration) - terminated)
            raise BarrierTimeout(
                f"restart barrier after iteration {iteration}: ranks {missing} did not "
                f"arrive within barrier_timeout"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def last_call(store: StoreMixin, state: State, exc: BaseException, wait: float) -> None:
    """This rank ends with ``exc``: tell the others (they restart without it), then
    wait up to ``wait`` seconds (``last_call_wait``) for concurrent terminal failures of
    other ranks and name them in ``exc``'s notes, so every rank's error tells the whole
    story."""
    rank, it = state.initial_rank, state.iteration
    everyone = frozenset(range(state.initial_world_size))
    try:
        store.record_terminated(rank)
        store.record_interruption(it, rank, "left", f"{type(exc).__name__}: {exc}")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not everyone <= store.terminated():
            time.sleep(0.01)
        others = [c for c in store.interruptions(it) if c["rank"] != rank]
    except Exception:
        return
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if others and add_note is not None:
        add_note(
            f"other ranks in iteration {it}: "
            + "; ".join(f"rank {c['rank']}: {c['detail']}" for c in others)
        )
