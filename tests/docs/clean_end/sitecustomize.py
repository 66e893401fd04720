"""Loaded by every Python process a page's blocks start (``PYTHONPATH``): at the
interpreter's exit, after the script's last line and before module teardown, a gloo
thread still alive means a process group outlived the script. torch then destroys it
while the interpreter finalizes, where its threads race for the GIL: a hang, or an abort
("terminate called without an active exception"). The troubleshooting page's "Ending a
DDP script cleanly" says how a script avoids it; ``test_doc_blocks`` fails a page whose
script does not, naming it."""

import atexit
import os
import sys


def _gloo_threads() -> list[str]:
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _check() -> None:
    log = os.environ.get("STEADFAST_DOCS_END_LOG")
    alive = _gloo_threads()
    if log and alive and not hasattr(sys, "last_value"):  # ended by an exception: a fault
        script = " ".join(sys.argv) or sys.executable
        rank = os.environ.get("RANK", "-")
        with open(log, "a") as f:
            f.write(f"{script} (rank {rank}): {', '.join(alive)} alive after the script\n")


atexit.register(_check)
