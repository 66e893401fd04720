"""The exit barrier: wait until every node of the round has finished its workers (or
is lost), up to a timeout. torch's exit barrier keeps the store's host alive while other
nodes may still need it; this one does the same so that it cannot hang a job.

torch's barrier blocks in one ``store.wait`` of up to 300 s on the round's store
*client*, which the rendezvous keep-alive and the roster's store threads share: a
TCPStore client serves one call at a time, so the wait stalls every other call on it and
any of them stalls the barrier's own ``add``. This one takes a connection of its own
(the round's ``waits``), marks this node done under its node rank, polls (never a long
blocking call), stops waiting for nodes found lost (by this launcher, or confirmed in
the store by any other: this one watches only its ring neighbours), and names the nodes
it waits for every 10 s. Whatever the round looks like from here (a node that holds
another rank, prefix or round than this one thinks, and so never marks the key this one
reads), it leaves at the timeout: no read of a key that may never come blocks it.

A node heard finishing over the ring marks its exit a moment later: the barrier waits up
to :data:`MARK_GRACE` for that mark before it counts the node finished without one.
Should the store's host leave first anyway, while this node still marks or polls, a
store error is no failure if every other node of the round said goodbye over the ring
(or is lost), waited for up to a second. Otherwise the error is raised.

What it reads of the node roster (the ring's goodbyes, this launcher's losses) comes
through :class:`Heard`; the roster holds the round."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from .confirm import confirmed_losses
from .round import Round

__all__ = ["MARK_GRACE", "Heard", "exit_barrier"]

logger = logging.getLogger(__name__)

#: Seconds the exit barrier waits for the store mark of a node it heard finish over the
#: ring (the goodbye goes first, the mark a moment later).
MARK_GRACE = 2.0


class Heard(Protocol):
    """What the barrier reads of the node roster."""

    def heard(self) -> tuple[dict[int, float], set[int]]:
        """The nodes heard finishing over the ring (node rank -> when, monotonic) and
        the nodes found lost by this launcher."""
        ...

    def wait_heard(self, nodes: set[int], timeout: float) -> None:
        """Wait up to ``timeout`` until each of ``nodes`` was heard finishing or lost."""
        ...


def exit_barrier(current: Round, timeout: float, ring: Heard) -> tuple[list[str], list[str]]:
    """Wait for the other nodes of ``current`` (see the module), up to ``timeout``
    seconds. Returns the nodes it did not hear finish (by host, or ``node rank R`` where
    the round's store does not say) and those found lost."""
    start = time.monotonic()
    try:
        return _await_exits(current, timeout, ring)
    # the store's errors alone (DistError is a RuntimeError; torch's SignalException,
    # a stop while waiting, is neither and goes on to the launcher)
    except (RuntimeError, OSError) as exc:
        grace = min(1.0, max(0.0, start + timeout - time.monotonic()))
        lost = _others_finished(current, grace, ring)
        if lost is None:
            raise
        logger.info("exit barrier: the store's host left (%s) after every node finished", exc)
        return [], [current.peers[r].host for r in sorted(lost)]


def _others_finished(current: Round, grace: float, ring: Heard) -> set[int] | None:
    """The lost nodes, once every node of ``current`` but this one said goodbye over
    the ring or was found lost (waited for up to ``grace`` seconds); None if some node
    was not heard of (it may not be watched from here)."""
    others = set(range(current.nodes)) - {current.rank}
    ring.wait_heard(others, grace)
    finished, lost = ring.heard()
    return lost & others if others <= set(finished) | lost else None


def _await_exits(current: Round, timeout: float, ring: Heard) -> tuple[list[str], list[str]]:
    """The store's side of :func:`exit_barrier`."""
    store = current.waits  # a connection of its own
    keys = current.keys
    store.set(keys.exit(current.rank), b"1")
    if int(store.add(keys.exit_count, 1)) >= current.nodes:
        store.set(keys.exit_all, b"1")
    start = time.monotonic()
    deadline, report, pause = start + timeout, start + 10.0, 0.005
    confirmed: set[int] = set()  # losses other launchers recorded in the store
    lost: set[int] = set()

    def name(r: int) -> str:  # never a blocking read: the key may never come
        if r in current.peers.known() or store.check([keys.node(r)]):
            return current.peers[r].host
        return f"node rank {r}"

    def unfinished() -> list[str]:  # O(N) reads: for the log only
        heard = set(ring.heard()[0])
        return [
            name(r) for r in range(current.nodes)
            if r not in lost and r not in heard and not store.check([keys.exit(r)])
        ]  # fmt: skip

    marked: set[int] = set()  # nodes heard finishing whose mark this node saw
    unmarked: set[int] = set()  # nodes heard finishing, their mark not seen yet
    while not store.check([keys.exit_all]):
        confirmed = confirmed_losses(store, current, confirmed)
        finished_at, seen_lost = ring.heard()
        lost = seen_lost | confirmed
        # nodes that said goodbye over the ring: finished, whether or not this node can
        # see their mark (another view of the round's keys)
        heard = set(finished_at) - marked - lost
        if lost or heard:  # every node left finished: the lost ones never will
            finished = int(store.add(keys.exit_count, 0))  # before the marks: a
            # mark read after the count may be counted by neither, never by both
            marked.update(r for r in heard if store.check([keys.exit(r)]))
            finished -= sum(1 for r in lost if store.check([keys.exit(r)]))
            unmarked = heard - marked
            if finished + len(lost) + len(unmarked) >= current.nodes:
                last = max((finished_at.get(r, 0.0) for r in unmarked), default=0.0)
                # a node heard finishing marks its exit a moment later: wait for its
                # mark up to MARK_GRACE (this may be the store's host: leaving closes
                # the store under it), never longer (one with another view of the
                # round's keys never marks the one read here)
                if not unmarked or time.monotonic() - last >= MARK_GRACE:
                    return [], sorted(name(r) for r in lost)
        now = time.monotonic()
        if now > report:
            waiting = unfinished()
            if waiting:
                logger.info(
                    "waiting for %s to finish their workers (%.0f s so far)",
                    ", ".join(waiting),
                    now - start,
                )
            report = now + 10.0
        if now > deadline:
            waiting = unfinished()
            if not waiting and unmarked:  # each node left said goodbye: done
                return [], sorted(name(r) for r in lost)
            waiting = waiting or ["some nodes"]
            logger.warning(
                "exit barrier: did not hear %s finish within %.0f s "
                "(job_end_timeout); leaving without them",
                ", ".join(waiting),
                timeout,
            )
            return waiting, sorted(name(r) for r in lost)
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
    return [], sorted(name(r) for r in lost)
