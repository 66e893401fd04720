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
import sys
import time

from ..launcher.as_main import run_as_main
from .probe import install


def main() -> None:
    began = time.monotonic()  # the interpreter's own start before it: a few ms
    args = sys.argv[1:]
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit("usage: python -m steadfast.progress.boot (script.py | -m module) ...")
    install(began)
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
