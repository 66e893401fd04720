"""A worker's side of its end: what it tells the launcher (its row's end marks), and the
process groups its script destroyed while something still held them, kept until they
can be freed safely.

**The marks.** A worker writes the moment its training is over into its row of the
launcher's heartbeat table (:mod:`steadfast.progress.layout`), and the launcher's
:class:`steadfast.monitor.ranks.Ranks` moves the rank's state on from it:

- ``COLLECTIVES_DONE``: its script's ``destroy_process_group()`` (of the default group)
  returned. It can no longer be part of a collective; what follows is the script's own
  tail (a final save) and its exit. A hang or a signal from here on is teardown.
- ``FINISHED``: its ``__main__`` returned, or it called ``sys.exit(0)``: only the
  interpreter's exit is left, bounded by ``teardown_timeout``.
- ``ENDED``: its script raised or exited non-zero: a failure, on its way out.

**The groups kept.** pytorch/examples' DDP tutorial keeps its ``Trainer`` (and so its DDP
model) in ``main()``'s frame, calls ``destroy_process_group()`` and returns. The model is
freed as ``main()`` returns; its ``Reducer`` then holds the last reference to the gloo
group, and ``~ProcessGroupGloo`` runs in the Reducer's dealloc, which keeps the GIL
while it joins gloo's worker threads. gloo's worker drops its last reference to the
step's final all-reduce right after completing it, and that work's
``ThreadLocalState`` holds a Python object (the ``contextvars.Context`` that torch's
``_engine_run_backward`` stashes during every ``backward()``), whose release needs the
GIL. When the main thread wins the GIL after the final all-reduce and reaches ``main()``'s
return within the interpreter's switch interval (5 ms: the tail of the loop and
``destroy_process_group()``), both wait for each other for ever (or, in an interpreter
already finalizing, the worker thread is ended mid-destructor: "terminate called
without an active exception", SIGABRT). torchrun's workers meet it as often as ours.

Here ``destroy_process_group`` is wrapped (in ``torch.distributed`` and
``torch.distributed.distributed_c10d``, before the script runs; ``__wrapped__`` is
torch's). A group it destroys that nothing else holds is freed at once, as torch frees
it. One that something still holds (a live DDP model's ``process_group``; torch's own
caches may hold it too) is kept referenced here, so that the Reducer's release is never
the last: it is dropped at the next ``destroy_process_group()`` that finds it held by
nothing else, or by an ``atexit`` handler (the interpreter fully alive, every thread
still served the GIL). Either way it is freed through its Python object, whose dealloc
releases the GIL before ``~ProcessGroupGloo`` (torch binds process groups with a no-GIL
destructor): gloo's thread takes the GIL, frees its work, and the join returns. No
thread of ours is started for it.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time
from typing import Any

__all__ = ["COLLECTIVES_DONE", "ENDED", "FINISHED", "install", "kept_groups", "mark"]

# the marks, as the row's slots name them (steadfast.progress.layout, the one owner)
from ..progress.layout import COLLECTIVES_DONE, ENDED, FINISHED

_kept: list[Any] = []  # destroyed groups that something else still held
_installed = False


def _counts(objs: list[Any]) -> list[int]:
    return [sys.getrefcount(o) for o in objs]


#: what :func:`_counts` reads of an object that only its list holds (measured, not
#: assumed: interpreters count a loop variable's reference differently)
_ALONE = _counts([object()])[0]


def _keep(groups: list[Any]) -> None:
    """Keep ``groups`` (just destroyed) while something else holds them; drop every
    kept group nothing else holds any more (each is freed here, the GIL released
    around its destructor)."""
    _kept.extend(g for g in groups if g is not None)
    groups.clear()
    free = [i for i, n in enumerate(_counts(_kept)) if n <= _ALONE]
    for i in reversed(free):
        del _kept[i]


def mark(slot: int) -> None:
    """Write the monotonic time now into ``slot`` of this worker's row (one of
    :data:`COLLECTIVES_DONE`, :data:`FINISHED`, :data:`ENDED`). No table (a run without
    the launcher): nothing to say. Never raises: the worker ends as it would anyway."""
    from ..monitor.table import HB_TABLE_ENV, HeartbeatTable

    path = os.environ.get(HB_TABLE_ENV)
    if not path:
        return
    try:
        row = int(os.environ.get("LOCAL_RANK", "0"))
        table = HeartbeatTable.attach(path, row)
        slots, _ = table.progress_area(row)
        slots[slot] = time.monotonic()
        table.close()
    except Exception:  # the launcher's table gone
        pass


def kept_groups() -> list[Any]:
    """The destroyed process groups kept while something else holds them."""
    return list(_kept)


def _release() -> None:
    """The ``atexit`` handler: the groups still kept freed while the interpreter still
    serves the GIL to gloo's threads."""
    _kept.clear()


def install() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` in this worker (once), and
    register the release of the groups it destroys at the interpreter's exit. Without
    torch's distributed package: nothing."""
    global _installed
    if _installed:
        return
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:
        return
    if not dist.is_available():
        return
    from .. import seam

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        whole = group is None or group is c10d.GroupMember.WORLD
        held = seam.process_groups() if whole else [group]
        original(group)
        _keep(held)
        if whole:
            mark(COLLECTIVES_DONE)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    atexit.register(_release)
    _installed = True
