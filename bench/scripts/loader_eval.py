"""A DDP script with DataLoader workers and an evaluation pass each epoch (issue 50's
clean-ends bench): 2 workers per rank, AdamW, gradient clipping, ``torch.no_grad()``
evaluation, DDP alive at ``destroy_process_group()``. ``argv[1]``: epochs (2), each
announced as the DDP tutorial does (``[GPUr] Epoch e``)."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    dist.init_process_group("gloo")
    data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    train = DataLoader(data, batch_size=32, sampler=DistributedSampler(data), num_workers=2)
    held_out = DataLoader(data, batch_size=64, num_workers=2)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        print(f"[GPU{dist.get_rank()}] Epoch {epoch}", flush=True)
        train.sampler.set_epoch(epoch)
        model.train()
        for x, y in train:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        model.eval()
        with torch.no_grad():
            total = sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in held_out)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} eval {total:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
