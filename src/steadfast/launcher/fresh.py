"""What a worker forked from the template redoes so that it is the process torchrun would
have started: a new interpreter, ``exec``'d by the launcher.

A fork copies the template's memory, so every worker would start from the template's
random generators (torch's default generator, numpy's global state, sympy's, which the
preloaded compiler imports: every rank the same draws), its signal dispositions and mask,
its session and its stdio. The launcher sends, with each request, what an ``exec`` from
it would have kept (:func:`launcher_state`: the signals it ignores, its signal mask,
umask, resource limits); the child applies them and draws fresh entropy for every
generator a new interpreter would have seeded from the OS (:func:`fresh_random_streams`).
A script that seeds then gets exactly the streams it seeds.

The generators found in the template after its preloads are checked against this list by
``tests/unit/test_fresh.py``: a torch that adds one fails that test, naming it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "RESEEDED",
    "apply_launcher_state",
    "fresh_random_streams",
    "held_generators",
    "launcher_state",
]

#: Every generator a fresh interpreter seeds from the OS at import and a forked worker
#: inherits from the template, as ``module:attribute``, each drawn again by
#: :func:`fresh_random_streams` (Python's ``random`` is reseeded by CPython itself at
#: every fork); the multiprocessing authkey, a secret of the same kind, is drawn too.
RESEEDED = (
    "torch:default_generator",
    "numpy.random.mtrand:_rand",
    "sympy.core.random:rng",
    "sympy.core.random:_assumptions_rng",
    "sympy.core.symbol:Dummy._prng",
)

#: Resource limits the launcher passes on (what an exec keeps); RLIMIT_* names.
_LIMITS = tuple(
    getattr(resource, name)
    for name in (
        "RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE",
        "RLIMIT_MEMLOCK", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_RSS", "RLIMIT_STACK",
        "RLIMIT_MSGQUEUE", "RLIMIT_NICE", "RLIMIT_RTPRIO", "RLIMIT_SIGPENDING",
    )
    if hasattr(resource, name)
)  # fmt: skip


def launcher_state() -> dict[str, Any]:
    """In the launcher, at a worker's spawn: what a worker ``exec``'d by it now would
    inherit, and a forked one must be given (JSON-able)."""
    ignored = []
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) == signal.SIG_IGN:
                ignored.append(int(sig))
    return {
        "ignored": ignored,
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "umask": _umask(),
        "limits": {str(int(r)): list(resource.getrlimit(r)) for r in _LIMITS},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


def _umask() -> int:
    """This process's umask, read without setting it (another thread may create a file
    meanwhile): ``/proc/self/status`` (Linux 4.7+), else set and put back."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_launcher_state(state: dict[str, Any]) -> None:
    """In the forked worker: the dispositions an ``exec`` from the launcher gives (what
    it ignores stays ignored, every handler back to the default), then the Python
    interpreter's own (SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt
    unless ignored); the launcher's signal mask, umask, limits and niceness."""
    ignored = set(state.get("ignored", ()))
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_IGN if int(sig) in ignored else signal.SIG_DFL)
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    if int(signal.SIGINT) not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [signal.Signals(s) for s in state.get("mask", ())])
    if "umask" in state:
        os.umask(int(state["umask"]))
    for key, (soft, hard) in state.get("limits", {}).items():
        with contextlib.suppress(ValueError, OSError):
            if resource.getrlimit(int(key)) != (soft, hard):
                resource.setrlimit(int(key), (soft, hard))
    nice = state.get("nice")
    if nice is not None and os.getpriority(os.PRIO_PROCESS, 0) != nice:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, int(nice))


def held_generators() -> Iterator[tuple[str, Any]]:
    """``(module, generator)`` for each of :data:`RESEEDED` this process has imported."""
    for entry in RESEEDED:
        module, _, path = entry.partition(":")
        generator: Any = sys.modules.get(module)
        for part in path.split("."):
            generator = getattr(generator, part, None)
        if generator is not None:  # else not imported: a worker seeds its own
            yield module, generator


def fresh_random_streams() -> None:
    """Draw fresh OS entropy for every generator of :data:`RESEEDED` that the template
    holds, as a new interpreter's imports would have (distinct across ranks and runs),
    and a new multiprocessing authkey. torch's CUDA generators are not among them: CUDA
    is never initialised in the template, so a worker creates its own, as a new process
    does."""
    for module, generator in held_generators():
        if module.startswith("numpy."):
            # numpy's global RandomState: what its import makes, a new RandomState()
            generator.set_state(type(generator)().get_state())
        else:
            # random.Random, or torch's CPU generator alone (torch.seed() would also seed
            # CUDA's, which a new process leaves at their default until the script seeds)
            generator.seed()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:  # a new process's authkey, as multiprocessing's import makes
        process.current_process().authkey = os.urandom(32)
