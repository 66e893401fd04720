"""The README's first script (DDP alive at ``destroy_process_group()``, module level,
never seeded per rank), with a teardown fault the test asks for on rank 1:

- ``atexit-hang``: an ``atexit`` handler that never returns (after the script finished);
- ``abort-after``: SIGABRT in an ``atexit`` handler (torch's "terminate called without
  an active exception" at teardown);
- ``abort-before``: SIGABRT before the script finished, once (a marker beside the
  trace): a fault, restarted.

Each rank appends ``trained RANK`` to ``--trace`` when its training loop is done.
"""

import atexit
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

mode, trace = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(5):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad(), loss.backward(), opt.step()
with open(trace, "a") as fh:
    fh.write(f"trained {rank}\n")
marker = trace + ".aborted"
if rank == 1 and mode == "abort-before" and not os.path.exists(marker):
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGABRT)
if rank == 1 and mode == "atexit-hang":
    atexit.register(time.sleep, 3600)
if rank == 1 and mode == "abort-after":
    atexit.register(os.kill, os.getpid(), signal.SIGABRT)
dist.destroy_process_group()
