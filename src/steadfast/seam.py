"""The one place where steadfast touches a private of torch (or of Python's standard
library).

Everything else in steadfast uses public names only. Each function here is one touch
point, with a contract test in ``tests/unit/test_seam.py`` that runs the private the way
steadfast uses it: a torch upgrade that moves or changes one fails that test, with the
touch point's name, instead of failing a training job.

Touch points and why each is needed:

- :func:`terminate_process_handler`: torch's agent installs its signal handler (which
  turns a signal into ``SignalException`` so the agent stops the workers with it) only
  when it first starts workers; the launcher installs the same handler from its start.
- :func:`launch_agent`: torch's public ``launch_agent`` builds its agent from the
  module-global ``LocalElasticAgent``; the launcher runs it with steadfast's agent in that
  name's place, so that torch's launch path (health-check server, metrics, the agent's
  success and failure events, ``ChildFailedError``) is torch's own, not a copy.
- :func:`start_processes_from`: torch's ``LocalElasticAgent._start_workers`` calls the
  ``start_processes`` of its own module; for the worker template it must call
  steadfast's for one call.
- :func:`subprocess_context_type`: the template's process context is torch's
  ``SubprocessContext`` with ``_start`` overridden (forked workers instead of
  ``Popen``), filling ``subprocess_handlers`` as torch's ``_start`` does.
- :func:`agent_pcontext`, :func:`agent_remaining_restarts`, :func:`agent_shutdown`:
  ``LocalElasticAgent``'s process context (the workers' pids), restarts left, and its
  stop-the-workers method with a signal and timeout.
- :func:`rendezvous_node_id`, :func:`expire_rendezvous_nodes`,
  :func:`rendezvous_join_timeout`: torch's dynamic rendezvous (the ``c10d`` and
  ``etcd-v2`` backends) removes a node only when its keep-alive expires
  (``keep_alive_interval`` x ``keep_alive_max_attempt``, 15 s by default); a node that
  steadfast *knows* is lost is marked expired at once (its last keep-alive set to the
  epoch, written back with the backend's compare-and-set, then torch's own sanitizer
  removes it), and the join after a node loss is bounded by ``node_lost_timeout``
  instead of the 600 s ``join_timeout`` (the handler's settings for one call).
- :func:`abort_all_process_groups`, :func:`process_groups`: c10d's
  ``_abort_process_group`` (abort every group and clear the registry so
  ``init_process_group`` can run again in the same process) and ``_world.pg_names``
  (every live group, oldest first) for the in-process restart.
- :func:`process_group_stores`: c10d's ``_world.pg_map`` (the store each live group was
  made with), so that the in-process restart keeps the stores' connections when it cuts
  the groups' own.
- :func:`foreach_inf_norms`: ``torch._foreach_norm``, the infinity norms of many tensors
  in one fused kernel: the NaN check of every gradient costs one kernel per (device,
  dtype) group, not one per parameter.
- :func:`foreach_copy`: ``torch._foreach_copy_``, many tensors copied in one call: a
  snapshot's staging of a model's ~1,000 state tensors paid ~2.4 us of Python and
  dispatch per tensor copied one by one.
- :func:`weights_only_loads`: ``torch._weights_only_unpickler``, the unpickler behind
  ``torch.load(weights_only=True)``, on a plain pickle: the memory tier's flat snapshot
  header (:mod:`steadfast.checkpoint.flat`) is pickled by the C pickler, since
  ``torch.save`` calls its Python ``persistent_id`` for every object (6 ms of a 1,152-tensor
  state's 9 ms write), and is read back as safely as ``torch.load`` reads a file.
- :func:`preload` (:data:`PRELOADED`): the worker template imports
  ``torch._dynamo`` (torch's optimizers import it on their first construction, ~1.6 s
  per worker) and Inductor's compiler (``torch._inductor.compile_fx``: ``torch.compile``
  imports it on its first call, ~1.4 s per worker) for the workers it forks; optional,
  a worker that needs them imports them itself.
- :func:`cuda_built` and :func:`cuda_fork_poisoned` (``torch.cuda._is_in_bad_fork``):
  whether a preload must be probed, and, in the probe's grandchild, whether the import
  initialised CUDA in its parent (steadfast.launcher.preload).
- :func:`on_compile`: torch.compile's own start and end callbacks
  (``torch._dynamo.callback_handler``: the outermost compilation of a frame, a lazy
  backward's), for the compile phase of a worker's start (steadfast.progress.phases).
- :func:`inductor_header_dir`: where Inductor keeps its precompiled C++ header
  (``torch._inductor.codecache._HEADER_DIR``), which the job's compile cache shares
  with spares (steadfast.launcher.compile_cache).
- :func:`dataloader_iterator_type`: the base class of every ``DataLoader`` iterator
  (``torch.utils.data.dataloader._BaseDataLoaderIter``), whose ``__next__`` the phases
  time until the first iteration (the first batch), then restore.
- :func:`interpreter_exit`: what the interpreter does at exit (``threading._shutdown``
  then ``atexit._run_exitfuncs``), for the launcher, which ends with ``os._exit``.
- :func:`run_module_as_main`: ``runpy._run_module_as_main``, what ``python -m module``
  runs: the module in the interpreter's own ``__main__`` (runpy's public
  ``run_module`` runs it in a temporary module that it drops on return), for a worker
  forked from the template or booted with the progress hooks
  (steadfast.launcher.as_main).

The agent's protected hooks (``_rendezvous``, ``_start_workers``, ``_stop_workers``,
``_monitor_workers``, ``_restart_workers``) are torch's extension points for agent
subclasses; their call order is part of the same contract test.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


__all__ = [
    "abort_all_process_groups",
    "agent_pcontext",
    "agent_remaining_restarts",
    "agent_shutdown",
    "expire_rendezvous_nodes",
    "foreach_inf_norms",
    "PRELOADED",
    "PRELOADED_BY_ALL",
    "COMPILER",
    "inductor_header_dir",
    "dataloader_iterator_type",
    "interpreter_exit",
    "run_module_as_main",
    "on_compile",
    "launch_agent",
    "option_actions",
    "preload",
    "cuda_built",
    "cuda_fork_poisoned",
    "process_group_stores",
    "process_groups",
    "rendezvous_join_timeout",
    "rendezvous_node_id",
    "start_processes_from",
    "subprocess_context_type",
    "terminate_process_handler",
]


# ------------------------------------------------------------------ torch.distributed.elastic
def terminate_process_handler() -> Callable[[int, Any], None]:
    """torch's agent signal handler: raises ``SignalException(sigval)``."""
    api = _module("torch.distributed.elastic.multiprocessing.api")
    return api._terminate_process_handler  # type: ignore[no-any-return]


def launch_agent(
    agent_factory: Callable[..., Any], config: Any, entrypoint: Any, args: list[Any]
) -> Any:
    """Run torch's public ``launch_agent(config, entrypoint, args)`` with
    ``agent_factory(**kwargs)`` building the agent (it gets the keyword arguments torch
    gives ``LocalElasticAgent``). Returns what ``launch_agent`` returns; raises what it
    raises (``ChildFailedError`` when the workers failed)."""
    api = _module("torch.distributed.launcher.api")
    original = api.LocalElasticAgent
    api.LocalElasticAgent = agent_factory
    try:
        return api.launch_agent(config, entrypoint, args)
    finally:
        api.LocalElasticAgent = original


@contextlib.contextmanager
def start_processes_from(replacement: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Within the block, ``LocalElasticAgent._start_workers`` starts its workers with
    ``replacement`` (called with torch's keyword arguments of ``start_processes``).
    Yields the original, for the cases ``replacement`` hands back to it."""
    lea = _module("torch.distributed.elastic.agent.server.local_elastic_agent")
    original = lea.start_processes
    lea.start_processes = replacement
    try:
        yield original
    finally:
        lea.start_processes = original


def subprocess_context_type() -> type[Any]:
    """torch's ``SubprocessContext``, whose private ``_start`` a subclass overrides: it
    must start ``self.nprocs`` processes (``self.args``, ``self.envs``,
    ``self.stdouts``, ``self.stderrs`` by local rank) and set
    ``self.subprocess_handlers`` to local rank -> an object with ``proc.pid`` and
    ``close(death_sig)``, which torch's ``pids()``, ``_poll`` and ``_close`` read."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    return SubprocessContext


def agent_pcontext(agent: Any) -> Any:
    """``LocalElasticAgent``'s process context of the running workers (or None)."""
    return agent._pcontext


def agent_remaining_restarts(agent: Any) -> int:
    """The in-job restarts the agent has left (``--max-restarts`` minus those used)."""
    return int(agent._remaining_restarts)


def agent_exit_barrier_timeout(agent: Any) -> float:
    """Seconds torch's agent waits at its exit barrier (``exit_barrier_timeout``)."""
    return float(agent._exit_barrier_timeout)


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (torch's versions differ)."""
    import inspect

    return name in inspect.signature(fn).parameters


def agent_grace(seconds: int) -> dict[str, Any]:
    """The keyword of ``LocalElasticAgent`` for the wait between SIGTERM and SIGKILL when
    it stops its workers on a signal (``shutdown_timeout``, in the torch steadfast is
    built on); empty for a torch without it (2.11: torch's fixed 30 s applies there;
    steadfast's own stops go through :func:`agent_shutdown` with their timeout)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return (
        {"shutdown_timeout": seconds}
        if _takes(LocalElasticAgent.__init__, "shutdown_timeout")
        else {}
    )


def agent_shutdown(agent: Any, death_sig: signal.Signals, timeout: int) -> None:
    """Stop the agent's workers: ``death_sig``, then SIGKILL after ``timeout`` seconds.
    A torch whose ``_shutdown`` takes no timeout (2.11) closes them with its process
    context's 30 s: they are closed here first, with ``timeout``."""
    if _takes(agent._shutdown, "timeout"):
        agent._shutdown(death_sig, timeout=timeout)
        return
    if agent._pcontext is not None:
        agent._pcontext.close(death_sig, timeout=timeout)
    agent._shutdown(death_sig)


# ------------------------------------------------------------- the dynamic rendezvous
def _dynamic(handler: Any) -> bool:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    return isinstance(handler, DynamicRendezvousHandler)


def rendezvous_node_id(handler: Any) -> list[Any] | None:
    """This agent's node in the rendezvous, as JSON-able ``[addr, pid, local_id]``
    (None for a handler other than torch's dynamic one: static, legacy etcd)."""
    if not _dynamic(handler):
        return None
    node = handler._this_node
    return [str(node.addr), int(node.pid), int(node.local_id)]


def rendezvous_round(handler: Any) -> int | None:
    """The round a dynamic rendezvous handler last joined: the number in the key prefix
    of the store its ``next_rendezvous`` handed out (``torch.rendezvous.<run>.<round>``),
    which stays while this node takes part in it (it moves on only once every
    participant has left). None for a handler other than torch's dynamic one."""
    if not _dynamic(handler):
        return None
    return int(handler._state_holder.state.round)


def stop_rendezvous_heartbeats(handler: Any) -> None:
    """Stop a dynamic rendezvous handler's keep-alive timer (``_stop_heartbeats``), as a
    node that is lost stops beating: the simulator's node loss, and its clean-up."""
    if _dynamic(handler):
        handler._stop_heartbeats()


def expire_rendezvous_nodes(handler: Any, node_ids: list[list[Any]], attempts: int = 10) -> int:
    """Mark the nodes ``node_ids`` (from :func:`rendezvous_node_id`) as having missed
    their keep-alive, so that every agent's next sync removes them (torch's sanitizer:
    from the participants, wait list and redundancy list). Returns how many of them the
    rendezvous still listed; 0 for a handler other than torch's dynamic one."""
    if not _dynamic(handler) or not node_ids:
        return 0
    from datetime import datetime, timezone

    wanted = {tuple(n) for n in node_ids}
    expired = datetime.fromtimestamp(0, timezone.utc)
    holder = handler._state_holder
    with handler._heartbeat_lock:  # not under a keep-alive of this handler
        for _ in range(attempts):
            holder.sync()
            beats = holder.state.last_heartbeats
            listed = [n for n in beats if (n.addr, n.pid, n.local_id) in wanted]
            if not listed:
                return 0
            for node in listed:
                beats[node] = expired
            holder.mark_dirty()
            if holder.sync():  # our compare-and-set won: the sanitizer has run on it
                return len(listed)
    return 0


@contextlib.contextmanager
def rendezvous_join_timeout(handler: Any, seconds: float) -> Iterator[None]:
    """Within the block, ``next_rendezvous`` gives up (``RendezvousTimeoutError``) after
    ``seconds`` instead of the handler's ``join_timeout``; other handlers: no effect."""
    if not _dynamic(handler):
        yield
        return
    import dataclasses
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    original = handler._settings
    t = original.timeout
    timeout = RendezvousTimeout(
        join=timedelta(seconds=seconds), last_call=t.last_call, close=t.close, heartbeat=t.heartbeat
    )
    handler._settings = dataclasses.replace(original, timeout=timeout)
    try:
        yield
    finally:
        handler._settings = original


# ------------------------------------------------------------------------------ c10d
def abort_all_process_groups() -> None:
    """Abort every process group and clear c10d's registry (main thread only)."""
    from torch.distributed import distributed_c10d as c10d

    c10d._abort_process_group()


def process_groups() -> list[Any]:
    """Every live process group, oldest first."""
    from torch.distributed import distributed_c10d as c10d

    names = c10d._world.pg_names
    return sorted(names, key=lambda g: names[g])


def process_group_stores() -> list[Any]:
    """The store each live process group was made with (c10d's registry), newest last."""
    from torch.distributed import distributed_c10d as c10d

    pg_map = c10d._world.pg_map
    return [store for _, store in pg_map.values() if store is not None]


# ------------------------------------------------------------------------ torch
def foreach_inf_norms(tensors: list[Any]) -> list[Any]:
    """The infinity norm of each of ``tensors`` (all of one device and dtype, none
    empty), as 0-d tensors on their device, in one fused kernel; one kernel per tensor
    if this torch has no ``_foreach_norm``."""
    import math

    import torch

    foreach_norm = getattr(torch, "_foreach_norm", None)
    if foreach_norm is None:  # pragma: no cover - every supported torch has it
        return [torch.linalg.vector_norm(t, math.inf) for t in tensors]
    return list(foreach_norm(tensors, math.inf))


def foreach_copy(dsts: list[Any], srcs: list[Any]) -> None:
    """Copy each of ``srcs`` into the ``dsts`` tensor at its place (same shapes and
    dtypes), in one call; one copy per tensor if this torch has no
    ``_foreach_copy_``. Autograd must not record it (the caller's ``no_grad``). No
    tensors: nothing (torch's call refuses an empty list)."""
    import torch

    if not dsts:
        return

    foreach_copy_ = getattr(torch, "_foreach_copy_", None)
    if foreach_copy_ is None:  # pragma: no cover - every supported torch has it
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
        return
    foreach_copy_(dsts, srcs)


def weights_only_loads(data: bytes | memoryview) -> Any:
    """Unpickle ``data`` (pickle protocol 2, as ``torch.save`` writes: the unpickler knows
    no later opcodes) as ``torch.load(weights_only=True)`` unpickles a file's objects:
    containers, scalars, dtypes, devices, sizes; anything else raises
    ``pickle.UnpicklingError``."""
    import io

    from torch import _weights_only_unpickler

    return _weights_only_unpickler.load(io.BytesIO(data))


#: What the worker template imports for its workers (steadfast.launcher.preload): torch's
#: optimizers import dynamo on their first construction (~2 s a worker on 2 cores),
#: ``torch.compile`` imports Inductor's compiler on its first call (~2 s a worker, in
#: every restart).
PRELOADED = ("torch._dynamo", "torch._inductor.compile_fx")
#: The ones of :data:`PRELOADED` every worker needs before its first step (any
#: ``torch.optim`` optimizer); the others only a script that compiles.
PRELOADED_BY_ALL = ("torch._dynamo",)
#: The one of :data:`PRELOADED` only a script that compiles needs (the template imports
#: it once a worker of the job compiled).
COMPILER = "torch._inductor.compile_fx"


def preload(name: str) -> bool:
    """Import ``name`` (one of :data:`PRELOADED`) now; False if it cannot be imported here
    (each is optional: a worker that needs it imports it itself). On a torch built with
    CUDA the template first tries it in a probe (steadfast.launcher.preload)."""
    try:
        _module(name)
    except Exception:
        return False
    return True


def cuda_built() -> bool:
    """Whether this torch is built with CUDA or ROCm (``torch.backends.cuda.is_built``:
    HIP's build answers through the same ``torch.cuda``, and its forks are poisoned
    alike)."""
    import torch

    return bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]


def cuda_fork_poisoned() -> bool:
    """In a forked process: whether its parent had initialised CUDA, so that no CUDA
    call can work here (``torch.cuda._is_in_bad_fork``, there on every build)."""
    import torch

    return bool(torch.cuda._is_in_bad_fork())


def on_compile(start: Callable[[], None], end: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``start`` and ``end`` around each outermost torch.compile compilation (torch's
    callback handler counts nested ones once); returns the function that removes them,
    or None where ``torch._dynamo`` is not imported (nothing can compile yet without
    importing it, which this never does: 1.6 s)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    handler = getattr(dynamo, "callback_handler", None)
    if handler is None:
        return None

    def on_start(_args: Any) -> None:
        start()

    def on_end(_args: Any) -> None:
        end()

    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            handler.remove_start_callback(on_start)
        with contextlib.suppress(ValueError):
            handler.remove_end_callback(on_end)

    return remove


def inductor_header_dir() -> Path:
    """Where Inductor keeps its precompiled C++ header (``codecache._HEADER_DIR``: the
    default cache folder, ``<tmp>/torchinductor_<user>/precompiled_headers``, whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says). Computed by the same rule, without importing
    Inductor (2 s in a launcher that compiles nothing); a contract test compares."""
    import getpass
    import os
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}" / "precompiled_headers"


def dataloader_iterator_type() -> type[Any]:
    """The base class of ``DataLoader``'s iterators (single- and multi-process), which
    defines the ``__next__`` they share."""
    return _module("torch.utils.data.dataloader")._BaseDataLoaderIter  # type: ignore[no-any-return]


# ------------------------------------------------------------------------ the stdlib
def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """argparse's option string -> action table of ``parser``."""
    return parser._option_string_actions


def interpreter_exit() -> None:
    """Join the non-daemon threads, then run the ``atexit`` handlers, as the interpreter
    does before it exits; errors in either are the handlers' own and are not raised."""
    import atexit
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()


def run_module_as_main(name: str, alter_argv: bool = True) -> None:
    """Run module ``name`` in ``sys.modules["__main__"]`` as ``python -m name`` does
    (with ``alter_argv``: ``sys.argv[0]`` becomes the module's file)."""
    import runpy

    runpy._run_module_as_main(name, alter_argv)  # type: ignore[attr-defined]


def thread_frame(ident: int) -> Any:
    """The frame thread ``ident`` runs now (``sys._current_frames``, documented for
    "internal and specialized purposes": a rank's stack read by a thread of steadfast
    while its main thread waits in C), None if that thread is gone."""
    import sys

    return sys._current_frames().get(ident)


def compiled_original(module: Any) -> Any:
    """The module ``torch.compile`` wrapped, where ``module`` is its ``OptimizedModule``
    (``_orig_mod``: a DDP model compiled whole is DDP inside), else ``module``."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        return module._orig_mod
    return module
