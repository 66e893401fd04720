"""Flags agreed on by an all-reduce that another component makes anyway.

An agreed flag (the shutdown every rank stops at) needs the ranks to count it every
step: an all-reduce of its own, which each step waits for or runs beside. The NaN check
(:class:`~steadfast.NaNDetector`) makes an all-reduce every step already, over the same
ranks, at the same point of every rank's loop. A :class:`Rider` is a flag that the next
such all-reduce over its group carries in one fixed slot: the count comes back with the
NaN verdict, and the flag costs no collective of its own.

The slot is always there (0 when no rider is aboard), so the carrying all-reduce has the
same size on every rank whatever riders a rank holds: a rank with a stale rider (a
handler abandoned by an exception) can never make the ranks' collectives differ. Which
riders get a count is decided by each rank's own calls, so riders must board and leave
at the same point of every rank's program, as collectives do: :class:`ShutdownHandler`
boards at its first agreed ``should_shutdown`` and leaves at its agreement or
``unregister``.

torch is imported only when a group is compared, as in :mod:`steadfast.dist`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Carried", "Rider", "carry"]

_lock = threading.Lock()
_aboard: list[Rider] = []


class Rider:
    """A flag agreed over ``group`` (the world when None) by the all-reduces that carry
    riders over it (:func:`carry`). ``flag()`` is read when one starts; :meth:`take`
    returns how many ranks had it up, or None when no all-reduce carried it since the
    last take (then agree some other way)."""

    def __init__(self, flag: Callable[[], bool], group: Any = None) -> None:
        self._flag = flag
        self.group = group
        self._count: int | None = None
        with _lock:
            _aboard.append(self)

    def take(self) -> int | None:
        """The largest count carried since the last take, or None when none was."""
        with _lock:
            count, self._count = self._count, None
        return count

    def close(self) -> None:
        """Leave: the next all-reduces carry this flag no more."""
        with _lock:
            if self in _aboard:
                _aboard.remove(self)


class Carried:
    """The riders one all-reduce carries: :attr:`up` is this rank's value of the slot
    (1.0 when any of them has its flag up); :meth:`deliver` hands them the summed slot."""

    def __init__(self, riders: list[Rider]) -> None:
        self._riders = riders
        self.up = 1.0 if any(r._flag() for r in riders) else 0.0

    def deliver(self, count: float) -> None:
        """Give each rider the slot's sum over the ranks (the count of ranks that had
        any flag up)."""
        n = int(count)
        with _lock:
            for r in self._riders:
                r._count = n if r._count is None else max(r._count, n)


def _same_group(a: Any, b: Any) -> bool:
    if a is b:
        return True
    import torch.distributed as dist

    world = dist.group.WORLD  # None before init_process_group
    return (a is None or a is world) and (b is None or b is world)


def carry(group: Any = None) -> Carried:
    """The riders aboard over ``group``, for an all-reduce over it that is about to start
    on every rank of it (in a single process, where riders never board, none)."""
    with _lock:
        riders = list(_aboard)
    return Carried([r for r in riders if _same_group(r.group, group)])
