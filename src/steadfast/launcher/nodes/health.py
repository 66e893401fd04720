"""The node health check: whether this node is fit to join a rendezvous (its checkpoint
directory writable with room to spare, its GPUs, the user's own command). The agent
runs it before each rendezvous; a node that fails it leaves the job (``node_unhealthy``)
and a spare may take its place."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from ...config import FaultToleranceConfig

__all__ = ["health_check"]


def health_check(ft: FaultToleranceConfig, gpus: int) -> tuple[str, str] | None:
    """This node's health before it joins a rendezvous: ``(check, reason)`` for the
    first check that failed, None when healthy. In order: ``node_health_check_dir``
    writable with ``node_min_free_gb`` free; each of ``gpus`` GPUs
    (:func:`~steadfast.health.check_gpu_health`, in a child process so that the launcher
    holds no CUDA context); the user's ``node_health_check`` command."""
    directory = ft.node_health_check_dir
    if directory is not None:
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".steadfast-health-") as f:
                f.write(b"x")
                f.flush()
                os.fsync(f.fileno())
            free = shutil.disk_usage(directory).free / 2**30
        except OSError as exc:
            return "checkpoint_dir", f"{directory} is not writable: {exc}"
        if free < ft.node_min_free_gb:
            return (
                "checkpoint_dir",
                f"{directory} has {free:.2f} GiB free, below node_min_free_gb="
                f"{ft.node_min_free_gb:g}",
            )
    if gpus > 0:
        done = _run(
            [sys.executable, "-m", "steadfast.cli", "health", "--all-devices", str(gpus)], 300
        )
        if done is not None:
            return "gpu", done
    if ft.node_health_check:
        done = _run(["sh", "-c", ft.node_health_check], 300)
        if done is not None:
            return "command", done
    return None


def _run(argv: list[str], timeout: float) -> str | None:
    """None when ``argv`` exits 0; else why, with the last line of its output."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"{argv[-1]!r} did not finish in {timeout:g} s"
    except OSError as exc:
        return f"cannot run {argv[0]}: {exc}"
    if done.returncode == 0:
        return None
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    tail = lines[-1].strip() if lines else "no output"
    return f"exit {done.returncode}: {tail}"
