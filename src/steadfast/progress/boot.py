"""``python -m steadfast.progress.boot script.py args`` (or ``-m module args``): a worker
started as a plain process (not forked from the worker template: ``--numa-binding``, a
template that could not start) installs the progress hooks, then runs its script as
``__main__``, as the interpreter would have.

The launcher puts this module before the script in the worker's command line; nothing is
written into the user's environment, so a ``sitecustomize`` of the user's runs as
before (the interpreter runs it at start-up, before this module).
"""

from __future__ import annotations

import os
import runpy
import sys
import time

from .probe import install


def main() -> None:
    began = time.monotonic()  # the interpreter's own start before it: a few ms
    args = sys.argv[1:]
    if not args:
        raise SystemExit("usage: python -m steadfast.progress.boot (script.py | -m module) ...")
    install(began)
    if args[0] == "-m" and len(args) >= 2:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
