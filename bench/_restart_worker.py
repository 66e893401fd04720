"""Worker for bench_launcher.py: steps of 3 ms; rank 1 kills itself at step 20 in the
first generation; every rank appends "generation step wall-time" lines to a file."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

out, kill = sys.argv[1], sys.argv[2] == "kill"
generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
client = None
if os.environ.get("STEADFAST_HB_TABLE"):
    from steadfast.monitor import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()
dist.init_process_group("gloo")
x = torch.ones(4)
with open(f"{out}.rank{rank}", "a") as fh:
    for step in range(40):
        if kill and generation == 0 and rank == 1 and step == 20:
            fh.write(f"kill {step} {time.time()}\n")
            fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if client:
            client.start_section("step")
        dist.all_reduce(x)
        time.sleep(0.003)
        if client:
            client.end_section("step")
        fh.write(f"{generation} {step} {time.time()}\n")
        fh.flush()
if client:
    client.shutdown_workload_monitoring()
dist.destroy_process_group()
