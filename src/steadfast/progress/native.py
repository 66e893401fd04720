"""Where a process is when its Python cannot say: its native stacks.

A rank whose main thread holds the GIL in C (``~ProcessGroupGloo`` joining gloo's
threads, a C extension that never releases it) cannot answer the progress thread's ask,
and a stopped one (``T``) or one in uninterruptible I/O (``D``) cannot either. The
launcher then asks py-spy (``py-spy dump --native``: it reads the process's memory and
unwinds every thread, C frames and Python frames interleaved, without the GIL and without
a line of the worker's help; a well-kept tool, installed with steadfast). Where py-spy
cannot attach (no ``CAP_SYS_PTRACE`` under a Yama ``ptrace_scope`` of 1 or more, a
seccomp policy), the kernel's view is given instead: each thread's name, state, the
kernel function it waits in (``wchan``) and, for root, its kernel stack.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["kernel_stacks", "native_stack"]

#: lines of a dump kept (the main thread's first, then the others')
MAX_LINES = 60


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # the launcher's own environment
    return str(beside) if beside.exists() else shutil.which("py-spy")


def native_stack(pid: int, timeout: float = 10.0) -> str:
    """Every thread of ``pid`` with its native and Python frames (py-spy), innermost
    first, the main thread first; the kernel's view (:func:`kernel_stacks`) where py-spy
    is not there or cannot attach, and for a process stopped or in uninterruptible I/O
    (py-spy's ptrace would resume a stopped process as it detaches, and block on one in
    ``D``). Never raises."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""
    tool = _py_spy() if state not in ("T", "t", "D") else None
    if tool is not None:
        try:
            done = subprocess.run(
                [tool, "dump", "--native", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            lines = [line.rstrip() for line in done.stdout.splitlines() if line.strip()]
            threads = [i for i, line in enumerate(lines) if line.startswith("Thread ")]
            if done.returncode == 0 and threads:
                return "\n".join(lines[threads[0] :][:MAX_LINES])
        except (OSError, subprocess.SubprocessError):
            pass
    return kernel_stacks(pid)


def kernel_stacks(pid: int) -> str:
    """Each thread of ``pid``: ``tid name state wchan`` and its kernel stack where
    readable (root). Empty where the process is gone."""
    out: list[str] = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return ""
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            name = Path(f"{base}/comm").read_text().strip()
            state = Path(f"{base}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        try:
            wchan = Path(f"{base}/wchan").read_text().strip()
        except OSError:
            wchan = ""
        out.append(f"Thread {tid} {name!r} state {state}" + (f" in {wchan}" if wchan else ""))
        try:
            kernel = Path(f"{base}/stack").read_text().splitlines()
        except OSError:
            kernel = []
        out.extend(f"    {line.split(' ', 1)[-1]}" for line in kernel[:8])
    return "\n".join(out[:MAX_LINES])
