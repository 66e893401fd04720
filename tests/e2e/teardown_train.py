"""The README's first script (DDP alive at ``destroy_process_group()``, module level,
never seeded per rank), with a teardown fault the test asks for on rank 1:

- ``atexit-hang``: an ``atexit`` handler that never returns (after the script finished);
- ``abort-after``: SIGABRT in an ``atexit`` handler (torch's "terminate called without
  an active exception" at teardown);
- ``abort-before``: SIGABRT before the script finished, once (a marker beside the
  trace): a fault, restarted;
- ``gil-after-destroy``: after its ``destroy_process_group()`` returned, a C call that
  keeps the GIL for an hour (the tutorial's deadlock: ``~ProcessGroupGloo`` joining
  gloo's threads with the GIL held);
- ``save-after-destroy``: rank 0 computes for 8 s after ``destroy_process_group()`` (a
  final save's work), then ends: moving, so not torn down;
- ``gil-peers-done``: after its training loop, before ``destroy_process_group()``, a C
  call that keeps the GIL for an hour, while rank 0 destroys its group and ends.

Each rank appends ``trained RANK`` to ``--trace`` when its training loop is done.
"""

import atexit
import ctypes
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
for _ in range(20):  # enough intervals for a learned bound (8)
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
if rank == 1 and mode == "gil-peers-done":
    ctypes.PyDLL(None).sleep(3600)  # a C call that never releases the GIL
dist.destroy_process_group()
if rank == 1 and mode == "gil-after-destroy":
    ctypes.PyDLL(None).sleep(3600)
if rank == 0 and mode == "save-after-destroy":
    end = time.monotonic() + 8
    while time.monotonic() < end:
        sum(range(10_000))
