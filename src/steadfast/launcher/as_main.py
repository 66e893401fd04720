"""A worker's script run as ``python [-u] script.py`` or ``python [-u] -m module`` runs
it: in the interpreter's own ``__main__`` module, with its ``argv``, ``sys.path[0]``,
stdio and ``__file__``, and ended by the interpreter's own exit.

Two places start a worker inside a process that is already running Python: the worker
template's forked child (:mod:`.template`) and ``python -m steadfast.launcher.boot``.
Both used ``runpy.run_path``, which runs the script in a temporary module and drops it
when the script returns: the script's globals (a DDP model the script never freed) were
destroyed right then, while the interpreter was not yet finalizing. torch 2.13's
``~ProcessGroupGloo`` joins gloo's threads holding the GIL, and one of them may wait for
the GIL to free a finished work: a deadlock that a fresh interpreter avoids, because it
destroys ``__main__``'s globals only during finalization, when a thread that asks for the
GIL is ended instead of served. Here the script's module *is* ``sys.modules["__main__"]``
and stays so; the caller returns to the interpreter's top level, which then exits as it
would for ``python script.py``: non-daemon threads joined, ``atexit`` handlers, module
teardown, flush.

What a fresh interpreter sets up at its start and a forked process cannot redo
(``sys.flags``, the hash seed, the modules already imported) is listed in
docs/guides/unchanged-scripts.md ("What differs from torchrun").
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import sys
import types
from collections.abc import Mapping
from importlib.machinery import BuiltinImporter, SourceFileLoader
from typing import Any

__all__ = ["fresh_main", "run_as_main", "stdio_as_python"]


def fresh_main() -> types.ModuleType:
    """A new, empty ``__main__`` module as the interpreter makes it at its start, put in
    ``sys.modules`` (the module that ran until now keeps running in its own globals)."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    module.__loader__ = BuiltinImporter
    if sys.version_info < (3, 14):  # PEP 649: no eager __annotations__ from 3.14 on
        module.__annotations__ = {}
    sys.modules["__main__"] = module
    return module


def run_as_main(kind: str, target: str, args: list[str], env: Mapping[str, str]) -> None:
    """Run ``target`` (``kind`` ``path``: a script file, or a folder or zip with a
    ``__main__.py``; ``module``: a module name) as ``__main__`` with ``args``.

    Returns when the script returns (the worker is then finished: its row's
    ``FINISHED`` mark, :func:`steadfast.launcher.worker_end.mark`);
    raises what it raises: ``SystemExit`` (marked finished for code 0 or None) and
    ``KeyboardInterrupt`` unchanged, any other exception printed as the interpreter
    prints it (from the script's frame inwards) and turned into ``SystemExit(1)``.
    The caller lets all of them reach its own top level."""
    from .. import seam
    from .worker_end import ENDED, FINISHED, mark

    main = fresh_main()
    safe_path = bool(getattr(sys.flags, "safe_path", False)) or bool(env.get("PYTHONSAFEPATH"))
    try:
        if kind == "module":
            sys.argv = ["-m", *args]  # runpy puts the module's file in argv[0]
            if not safe_path:
                sys.path.insert(0, os.getcwd())
            seam.run_module_as_main(target)
        elif os.path.isdir(target) or _is_zip(target):
            sys.argv = [target, *args]
            sys.path.insert(0, target)  # the folder or zip itself, even under -P
            seam.run_module_as_main("__main__", alter_argv=False)
        else:
            sys.argv = [target, *args]
            path = os.path.join(os.getcwd(), target)  # as Python 3.9+: absolute, not normalised
            if not safe_path:
                sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
            main.__file__ = path
            main.__dict__["__cached__"] = None
            main.__loader__ = SourceFileLoader("__main__", path)
            try:
                with open(path, "rb") as fh:
                    source = fh.read()
            except OSError as exc:  # what `python missing.py` says, and its exit code
                error = f"[Errno {exc.errno}] {exc.strerror}"
                print(f"{sys.executable}: can't open file {path!r}: {error}", file=sys.stderr)
                raise SystemExit(2) from None
            exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as exc:
        mark(FINISHED if exc.code is None or exc.code == 0 else ENDED)
        raise
    except KeyboardInterrupt:
        mark(ENDED)
        raise
    except BaseException as exc:
        mark(ENDED)
        tb = _from_script(exc.__traceback__)
        exc = exc.with_traceback(tb)
        # as the interpreter's own report does: kept in sys.last_* (the script's frames
        # with it) until the interpreter finalizes; freed here, a DDP model in main()'s
        # frame would join gloo's threads holding the GIL (the exit deadlock, again)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, tb)  # the hook prints exc's own traceback
        raise SystemExit(1) from None
    mark(FINISHED)


def _is_zip(path: str) -> bool:
    import zipfile

    return os.path.isfile(path) and zipfile.is_zipfile(path)


def _from_script(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the frames of steadfast's own start (this module, the seam, the
    template, the boot): what ``python script.py`` prints starts at the script."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _STARTERS:
        tb = tb.tb_next
    return tb


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STARTERS = frozenset(
    os.path.join(_PACKAGE, *part.split("/"))
    for part in ("launcher/as_main.py", "seam.py", "launcher/template.py", "launcher/boot.py")
)


def stdio_as_python(unbuffered: bool) -> None:
    """``sys.stdout`` and ``sys.stderr`` rebuilt as the interpreter builds them at its
    start for ``unbuffered`` (``-u`` or ``PYTHONUNBUFFERED``: written through) or not
    (block-buffered, line-buffered on a terminal; stderr always line-buffered), over
    the descriptors as they are now. The encoding and error handlers stay."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old: Any = getattr(sys, name)
        with contextlib.suppress(Exception):
            old.flush()
        raw = io.FileIO(fd, "wb", closefd=False)
        raw.name = f"<{name}>"
        buffer: Any = raw if unbuffered else io.BufferedWriter(raw)
        line = not unbuffered and (fd == 2 or os.isatty(fd))
        stream = io.TextIOWrapper(
            buffer,
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            newline="\n",
            line_buffering=line,
            write_through=unbuffered,
        )
        stream.mode = "w"  # type: ignore[misc]
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
