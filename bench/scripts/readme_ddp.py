"""The README's first script (issue 50's clean-ends bench): DDP alive at
``destroy_process_group()``, module level, no per-rank seed, no snapshot. ``argv[1]``:
epochs of 40 steps (1), each announced as the DDP tutorial does (``[GPUr] Epoch e``)."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    print(f"[GPU{dist.get_rank()}] Epoch {epoch}", flush=True)
    for _ in range(40):
        loss = model(torch.randn(64, 32)).pow(2).mean()
        opt.zero_grad(), loss.backward(), opt.step()
dist.destroy_process_group()
