"""What a worker can see of the process it was started as (issue 50's conformance
probe): run under torchrun and under ``steadfast launch`` with the same flags, each rank
writes ``RANK.json`` into ``$PROBE_OUT``; the test compares them field
by field against docs/guides/unchanged-scripts.md ("What differs from torchrun")."""

import gc
import json
import os
import random
import resource
import signal
import sys
import threading
from pathlib import Path

import __main__

MAIN = {k: type(v).__name__ for k, v in vars(__main__).items()}  # before any name below

from multiprocessing import current_process  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

STABLE_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "PYTHONPATH", "PATH", "HOME",
)  # fmt: skip


def stream(s):
    buffer = getattr(s, "buffer", None)
    return {
        "class": type(s).__name__,
        "buffer": type(buffer).__name__,
        "line_buffering": s.line_buffering,
        "write_through": s.write_through,
        "encoding": s.encoding,
        "errors": s.errors,
        "name": getattr(getattr(buffer, "raw", buffer), "name", None),
    }


def status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return line.split()[1]
    return None


def fd_kinds():
    """Each open descriptor's kind (pipe, socket, anon_inode, file), the listing's own
    descriptor left out."""
    kinds = []
    for fd in sorted(int(fd) for fd in os.listdir("/proc/self/fd")):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own, closed since
            continue
        kinds.append(target.split(":")[0] if ":" in target else ("file" if fd > 2 else target))
    return kinds


out = os.environ["PROBE_OUT"]
rank = os.environ["RANK"]
probe = {
    "file": __main__.__file__,
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "path": sys.path,
    "cwd": os.getcwd(),
    "main": MAIN,
    "flags": repr(sys.flags),
    "stdout": stream(sys.stdout),
    "stderr": stream(sys.stderr),
    "stdin": type(sys.stdin).__name__,
    "session_leader": os.getsid(0) == os.getpid(),
    "group_leader": os.getpgid(0) == os.getpid(),
    "sig_ignored": status("SigIgn"),
    "sig_blocked": status("SigBlk"),
    "sig_caught": status("SigCgt"),
    "sigint": repr(signal.getsignal(signal.SIGINT)),
    "rlimits": {
        name: resource.getrlimit(getattr(resource, name))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    },
    "umask": status("Umask"),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "affinity": sorted(os.sched_getaffinity(0)),
    "env_names": sorted(os.environ),
    "env": {k: os.environ.get(k) for k in STABLE_ENV},
    "python_threads": threading.active_count(),
    "os_threads": int(status("Threads")),
    "fds": fd_kinds(),
    "modules": len(sys.modules),
    "gc": [gc.isenabled(), gc.get_threshold(), gc.get_freeze_count() > 0],
    "torch_threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
    "cmdline": Path("/proc/self/cmdline").read_text().split("\0")[:-1],
    # drawn per rank: the test compares them across ranks, not across launchers
    "draws": {
        "torch": [torch.initial_seed(), torch.rand(1).item()],
        "numpy": float(np.random.rand()),
        "random": random.random(),
        "hash": hash("steadfast"),
        "authkey": bytes(current_process().authkey).hex(),
    },
}
if os.environ.get("STEADFAST_PROBE_CUDA") == "1":  # on a GPU (make gpu-check): CUDA works
    before = torch.cuda.is_initialized()  # a worker forked from the template: must be False
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    ones = torch.ones(1024, device="cuda")
    probe["cuda"] = {
        "initialized_before": before,
        "device": torch.cuda.current_device(),
        "count": torch.cuda.device_count(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "works": float(ones @ ones) == 1024.0,
    }
with open(os.path.join(out, f"{rank}.json"), "w") as fh:
    json.dump(probe, fh)
