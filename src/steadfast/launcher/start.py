"""How torch's agent starts a generation's workers under steadfast: forked from the
worker template (:mod:`.template`) where the command line allows, else as torch starts
them, with the progress hooks' boot before the script; every worker's exit code read
through the finished workers' teardown (:mod:`steadfast.monitor.teardown`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from .template import Template, TemplateProc, parse_python_argv

__all__ = ["template_start_processes", "with_progress_boot"]


def with_progress_boot(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch's ``start_processes`` arguments with ``-m steadfast.launcher.boot`` before
    each Python worker's script, where progress is watched (workers started as plain
    processes install the hooks that way)."""
    from ..progress.probe import PROGRESS_ENV

    if os.environ.get(PROGRESS_ENV) != "1" or kwargs.get("entrypoint") != sys.executable:
        return kwargs
    args = {}
    for local, argv in kwargs["args"].items():
        argv = [str(a) for a in argv]
        parsed = parse_python_argv(argv)
        if parsed is None:
            args[local] = tuple(argv)
            continue
        kind, target, rest = parsed
        flags = argv[: len(argv) - len(rest) - (2 if kind == "module" else 1)]
        script = ["-m", target] if kind == "module" else [target]
        args[local] = (*flags, "-m", "steadfast.launcher.boot", *script, *rest)
    return {**kwargs, "args": args}


class _FinishedAware:
    """A worker's process (torch's ``Popen`` or a :class:`TemplateProc`) whose exit code
    the agent reads through ``exit_code``: a worker that exits badly after its script
    finished is not a failure (:class:`steadfast.monitor.teardown.Teardown`)."""

    def __init__(self, proc: Any, local: int, exit_code: Callable[[int, int, int], int]) -> None:
        self._proc = proc
        self._local = local
        self._exit_code = exit_code
        self.pid = proc.pid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)

    def _seen(self, code: int | None) -> int | None:
        return None if code is None else self._exit_code(self._local, self.pid, code)

    @property
    def returncode(self) -> int | None:
        return self._seen(self._proc.returncode)

    def poll(self) -> int | None:
        return self._seen(self._proc.poll())

    def wait(self, timeout: float | None = None) -> int:
        code = self._seen(self._proc.wait(timeout))
        assert code is not None
        return code


def template_start_processes(
    template: Template | None, exit_code: Callable[[int, int, int], int] | None = None
) -> Any:
    """A stand-in for torch's ``start_processes`` that forks script workers from
    ``template`` and falls back to torch's for anything else (a module of
    :func:`steadfast.seam.start_processes_from`), each worker with the progress hooks.
    ``exit_code(local_rank, pid, code)``: the code the agent is to see for each
    worker's exit (a finished worker's teardown is not a failure)."""
    from torch.distributed.elastic.multiprocessing import start_processes as original

    from .. import seam

    base: Any = seam.subprocess_context_type()

    class _Handler:
        def __init__(self, proc: TemplateProc) -> None:
            self.proc = proc

        def close(self, death_sig: signal.Signals | None = None) -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, death_sig or signal.SIGTERM)

    class _TemplateContext(base):  # type: ignore[misc]
        def _start(self) -> None:
            handlers = {}
            for local_rank in range(self.nprocs):
                env = os.environ.copy()
                env.update(self.envs[local_rank])
                argv = [str(a) for a in self.args[local_rank]]
                out = self.stdouts[local_rank] or None
                err = self.stderrs[local_rank] or None
                assert template is not None
                proc = template.spawn(argv, env, stdout=out, stderr=err)
                handlers[local_rank] = _Handler(proc)
            self.subprocess_handlers = handlers

    def start_processes(**kwargs: Any) -> Any:
        # torch's agent passes every argument by keyword
        usable = (
            template is not None
            and template.ready(600)  # else (a very slow import, a dead template): plain start
            and kwargs["entrypoint"] == sys.executable
            and kwargs.get("numa_options") is None
            and all(parse_python_argv([str(a) for a in argv]) for argv in kwargs["args"].values())
        )
        if not usable:
            context = original(**with_progress_boot(kwargs))
        else:
            # the start method and (absent) NUMA binding do not apply to forked workers
            context_args = {
                k: v for k, v in kwargs.items() if k not in ("start_method", "numa_options")
            }
            context = _TemplateContext(**context_args)
            context.start()
        handlers = getattr(context, "subprocess_handlers", None)
        if exit_code is not None and handlers:
            for local_rank, handler in handlers.items():
                handler.proc = _FinishedAware(handler.proc, int(local_rank), exit_code)
        return context

    return start_processes
