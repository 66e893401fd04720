"""Worker for bench_fault_costs.py's hung rank under each launcher's own hang detection:
NVRx's documented pattern (``RankMonitorClient``, a heartbeat a step, timeouts calculated
from the steps seen), which ``steadfast launch`` serves with the same client API. Steps of
20 ms (an all-reduce and a sleep); rank 1 hangs in Python at step 30 of the first
generation. Every rank appends "generation step wall-time" lines to ``OUT.rankN``; the
hung rank writes "hang", and a watcher it starts (a session of its own, so that no
launcher's stop takes it along; it ends with the rank) writes "dead" the moment the
launcher ended it: the detection and the stop, the same for every launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

try:  # the launcher's own client: NVRx's under ft_launcher, steadfast's under steadfast
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
except ImportError:
    from steadfast.monitor import RankMonitorClient  # type: ignore[assignment]

#: waits for the pid in argv[1] to end (a pidfd), then appends "dead ... time" to argv[2]
WATCH = (
    "import os, select, sys, time\n"
    "fd = os.pidfd_open(int(sys.argv[1]))\n"
    "print('ready', flush=True)\n"
    "select.select([fd], [], [])\n"
    "open(sys.argv[2], 'a').write(f'dead 0 {time.time()}\\n')\n"
)

out = sys.argv[1]
generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
client = RankMonitorClient()
client.init_workload_monitoring()
dist.init_process_group("gloo")
x = torch.ones(4)
with open(f"{out}.rank{rank}", "a") as fh:
    for step in range(60):
        if generation == 0 and rank == 1 and step == 30:
            watcher = subprocess.Popen(
                [sys.executable, "-S", "-c", WATCH, str(os.getpid()), f"{out}.dead"],
                stdout=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
            assert watcher.stdout is not None and watcher.stdout.readline() == b"ready\n"
            fh.write(f"hang {step} {time.time()}\n")
            fh.flush()
            time.sleep(3600)
        dist.all_reduce(x)
        time.sleep(0.02)
        client.send_heartbeat()
        if step == 10:
            client.calculate_and_set_hb_timeouts()
        fh.write(f"{generation} {step} {time.time()}\n")
        fh.flush()
client.shutdown_workload_monitoring()
dist.destroy_process_group()
