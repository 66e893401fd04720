"""``python -m steadfast.launcher.boot script.py args`` (or ``-m module args``): a worker
started as a plain process (not forked from the worker template: ``--numa-binding``, a
template that could not start) installs the worker's hooks (:func:`worker_hooks`: the
progress hooks, the end's), then runs its script as ``__main__``, as the interpreter
would have.

The launcher puts this module before the script in the worker's command line; nothing is
written into the user's environment, so a ``sitecustomize`` of the user's runs as
before (the interpreter runs it at start-up, before this module).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from .as_main import run_as_main


def worker_hooks(began: float | None = None) -> Any:
    """What steadfast puts into every worker it starts before its script runs, forked
    from the template or booted: the end's (:mod:`.worker_end`: the destroyed groups
    kept until the exit) always, and the progress hooks (:mod:`steadfast.progress.probe`)
    where the launcher asked for them, in the row of the node's heartbeat table. Returns
    the progress probe, or None; never raises."""
    from .worker_end import install as install_end

    install_end()
    from ..progress.probe import PROGRESS_ENV, install

    if os.environ.get(PROGRESS_ENV) != "1":
        return None
    try:
        from ..monitor.table import HB_TABLE_ENV, HeartbeatTable

        path = os.environ[HB_TABLE_ENV]
        row = int(os.environ.get("LOCAL_RANK", "0"))
        table = HeartbeatTable.attach(path, row)
    except Exception:  # no table (a plain run): nothing to watch
        return None
    return install(table, row, began)


def main() -> None:
    began = time.monotonic()  # the interpreter's own start before it: a few ms
    args = sys.argv[1:]
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit("usage: python -m steadfast.launcher.boot (script.py | -m module) ...")
    worker_hooks(began)
    if not getattr(sys.flags, "safe_path", False):
        sys.path.pop(0)  # `python -m` put the cwd first: the script puts its own
    # the command line torchrun's worker would show: this module's part taken out
    orig = list(sys.orig_argv)
    if len(orig) >= len(args) + 2 and orig[-len(args) - 2 :][:2] == ["-m", __spec__.name]:
        sys.orig_argv = [*orig[: -len(args) - 2], *args]
    if args[0] == "-m":
        run_as_main("module", args[1], args[2:], os.environ)
    else:
        run_as_main("path", args[0], args[1:], os.environ)


if __name__ == "__main__":
    # the script runs at this module's top level, and the interpreter's own exit follows
    main()
