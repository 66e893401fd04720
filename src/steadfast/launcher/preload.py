"""What the worker template imports for its workers (:data:`steadfast.seam.PRELOADED`).

On a torch without CUDA, what every worker needs (:data:`steadfast.seam.PRELOADED_BY_ALL`:
dynamo, which any optimizer imports) before the template serves (:meth:`Preloader.eager`,
beside the launcher's own start). The rest (Inductor's compiler) only once the launcher
asks for it (:meth:`Preloader.want`: a worker of the job compiled), then while workers
run. Imported before serving, the compiler held every cold start (a first launch, a
requeue) ~2 s on 2 cores for a script that may never compile; imported for every job, it
took a core for seconds beside the training and added ~0.3 s to every worker's exit
(its interpreter frees ~250 more modules), for scripts that never compile; imported once
idle (no worker), it lands right after a worker ended: in a restart's way. On a CUDA
build one module at a time, each probed first, while no worker is asked for:

On a torch built with CUDA an import may ask for the GPUs (``device_count``, which
initialises CUDA's driver): every process forked after that fails at its first CUDA call
("Cannot re-initialize CUDA in forked subprocess"). Seen on a lent H200: importing
Inductor's compiler (``torch._inductor.compile_fx``) did it, and every restart's worker
died. So there each module is first imported in a forked child (the probe), which forks
a grandchild of its own to see whether a fork of it could still use CUDA; only a module
the probe cleared is imported into the template. The template never waits for a probe:
it polls it between requests (a request that came during a blocking probe waited ~6 s
on that host), and a probe that finds the template busy when it ends leaves its import
for the next idle moment.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
from collections.abc import Iterable, Iterator

from .. import seam

__all__ = ["Preloader", "die_with_parent", "uncollected"]

logger = logging.getLogger(__name__)


class Preloader:
    """The template's preloads. :meth:`poll` does the next bit of work (starts a probe,
    reads one, imports a cleared module) when the template is idle; :meth:`close` ends a
    probe still running."""

    def __init__(self, names: Iterable[str], by_all: Iterable[str] = ()) -> None:
        self._names = list(names)
        self._by_all = set(by_all)  # needed by every worker: before serving, without CUDA
        self._probe: tuple[int, str] | None = None  # (pid, module) of the running probe
        self._cleared: set[str] = set()  # probed: importing them keeps forks usable
        self._probing = seam.cuda_built()

    def eager(self) -> None:
        """Before the template serves, where no probe is needed (a torch built without
        CUDA): import what every worker needs now, beside the launcher's own start. A
        module imported once the template is idle is imported when it is idle *because*
        a worker just ended: in a restart's way (its workers waited for it: process_start
        1.7-2.3 s on a 2-core machine)."""
        if self._probing:
            return
        for name in [n for n in self._names if n in self._by_all]:
            with uncollected():
                seam.preload(name)
            self._names.remove(name)

    def want(self, name: str) -> None:
        """Preload ``name`` too (one of :data:`steadfast.seam.PRELOADED`), asked for by
        the launcher once the job showed it needs it (a worker compiled); a module
        already imported or pending is left as it is."""
        import sys

        if name in seam.PRELOADED and name not in sys.modules and name not in self._names:
            self._names.append(name)

    def idle(self, quiet: bool, running: bool, served: bool) -> bool:
        """Whether the template may probe or import now (``quiet``: no worker asked for
        lately; ``running``: workers run; ``served``: it forked workers before): once the
        first workers run (before, an import would hold up their start), and on a CUDA
        build also before it serves while no worker runs (a probe is a fork: it starts
        beside the launcher's rendezvous). A CUDA build used to import only while no
        worker ran, so a restart's workers (asked for as soon as the old ones ended)
        never found dynamo preloaded: process_start 5.0 s on a lent H200."""
        return quiet and (served or (self._probing and not running))

    def pending(self) -> bool:
        return bool(self._names) or self._probe is not None

    def poll(self, idle: bool) -> None:
        """Called by the template's loop between requests (``idle``: :meth:`idle`'s
        answer). Never blocks but for an import itself."""
        if self._probe is not None:
            pid, name = self._probe
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                return
            self._probe = None
            code = os.waitstatus_to_exitcode(status)
            if code == 0:
                self._cleared.add(name)
                return
            self._names.remove(name)
            if code == _POISONS:
                logger.info("not preloaded: importing %s would keep forks off CUDA", name)
            return
        if not idle or not self._names:
            return
        name = self._names[0]
        if self._probing and name not in self._cleared:
            try:
                self._probe = (_probe(name), name)
            except OSError as exc:  # no fork now (EAGAIN, ENOMEM): the workers import it
                self._names.pop(0)
                logger.info("not preloaded: %s could not be probed (%s)", name, exc)
            return
        self._names.pop(0)
        with uncollected():
            seam.preload(name)

    def close(self) -> None:
        """Kill and reap a probe still running."""
        if self._probe is not None:
            pid, _ = self._probe
            self._probe = None
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


#: The probe's exit code when the import kept forks off CUDA (1: it failed).
_POISONS = 3


def _probe(name: str) -> int:
    """Fork the probe of ``name``: it exits 0 when a process that imported it can still
    fork workers that use CUDA, :data:`_POISONS` when it cannot, 1 when the import
    failed."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # nothing of the template's: its socket to the launcher (whose EOF must come
            # when the template dies), its wake-up pipe; and gone with it (a template is
            # SIGKILLed at the launcher's end, maybe while a probe imports)
            signal.set_wakeup_fd(-1)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            die_with_parent()
            if seam.preload(name):
                grandchild = os.fork()
                if grandchild == 0:
                    os._exit(_POISONS if seam.cuda_fork_poisoned() else 0)
                code = os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1])
        finally:
            os._exit(code)
    return pid


@contextlib.contextmanager
def uncollected() -> Iterator[None]:
    """Import (torch, dynamo, the compiler) without the cyclic collector, then freeze
    what is there: an import of torch and dynamo ran ~700 collections (5 of them full)
    over the objects it had made so far (0.6 s of its ~3.5 s of CPU), objects
    that live as long as the process (the template; a launcher, :func:`.main.main`);
    frozen, no later collection of it or of a worker the template forks walks them (see
    the fork in :func:`.template.serve`). A cycle left by the import is kept, as the
    module it came from is."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``): a worker
    or a probe never outlives the template that forked it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the template's EOF handling remains
        pass
