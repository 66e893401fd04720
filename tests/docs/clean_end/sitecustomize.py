"""Loaded by every Python process a page's blocks start (``PYTHONPATH``).

What the test measures on its own, where ``STEADFAST_DOCS_MEASURE`` names a folder:
each process's start (the kernel's) and end (its last exit handler), and each optimizer
step that global rank 0 ends (a hook on torch's optimizers, registered when
``torch.optim.optimizer`` is imported), one file per process. ``tests/sffigures.py`` holds the
reports the page prints against them.

And the end: at the
interpreter's exit, after the script's last line and before module teardown, a gloo
thread still alive means a process group outlived the script. torch then destroys it
while the interpreter finalizes, where its threads race for the GIL: a hang, or an abort
("terminate called without an active exception"). The troubleshooting page's "Ending a
DDP script cleanly" says how a script avoids it; ``test_doc_blocks`` fails a page whose
script does not, naming it."""

import atexit
import importlib.abc
import os
import sys
import time


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


# ---------------------------------------------------------------- what the test measures
_OUT = os.environ.get("STEADFAST_DOCS_MEASURE")
_files: dict[int, object] = {}


def _record(line: str) -> None:
    pid = os.getpid()
    f = _files.get(pid)
    if f is None:  # one file per process (a forked worker opens its own)
        f = _files[pid] = open(os.path.join(_OUT, f"{pid}.txt"), "a", buffering=1)  # noqa: SIM115
        if not line.startswith("start"):  # forked: it began where it was forked
            f.write(f"start {_started():.6f} (forked)\n")  # type: ignore[attr-defined]
    f.write(line + "\n")  # type: ignore[attr-defined]


def _started() -> float:
    """This process's start, read from the kernel here, not through steadfast's
    ``process_start_time``: the measure must not rest on the code it checks, and this
    file runs before every Python process of a page, steadfast imported or not."""
    with open("/proc/self/stat", "rb") as fh:
        ticks = int(fh.read().decode().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _step(*_: object) -> None:
    if os.environ.get("RANK") == "0":
        _record(f"step {time.time():.6f}")


class _Hook(importlib.abc.MetaPathFinder):
    """Registers :func:`_step` once ``torch.optim.optimizer`` has run."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torch.optim.optimizer":
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            run(module)
            module.register_optimizer_step_post_hook(_step)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _end() -> None:
    _record(f"end {time.time():.6f}")


if _OUT:
    _record(f"start {_started():.6f} {' '.join(sys.argv)}")
    sys.meta_path.insert(0, _Hook())
    atexit.register(_end)  # registered first: it runs last
