"""Clean training shapes a replica check must not take for corruption (issue 69): a
torchrun script that imports nothing of steadfast, whose ranks either are DDP's
replicas (which must agree bit for bit) or legitimately differ (which must not be
compared). ``argv[1]``, the shape:

- ``dropout``: DDP, dropout, a DataLoader with two worker processes;
- ``no_sync``: DDP, gradients accumulated over 3 micro-batches under ``no_sync``;
- ``bf16``: DDP under bf16 autocast;
- ``compile``: ``torch.compile`` of the DDP model (``aot_eager``: no C++ build);
- ``fsdp2``: FSDP2's ``fully_shard`` (each rank holds its shard);
- ``hsdp``: FSDP2 over a 2x2 mesh (replicate x shard; 4 ranks);
- ``apart``: a model of its own per rank, each with its own seed, no DDP;
- ``batchnorm``: DDP with BatchNorm (buffers differ in between broadcasts).

``argv[2]``: steps (60). Every rank's batches differ (seeded by the rank).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    def __init__(self, rank: int, steps: int) -> None:
        self.rank, self.steps = rank, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * i + self.rank)
        return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


def net(dropout: bool = False, norm: bool = False) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, 64)]
    if norm:
        layers.append(torch.nn.BatchNorm1d(64))
    layers += [
        torch.nn.ReLU(),
        *([torch.nn.Dropout(0.3)] if dropout else []),
        torch.nn.Linear(64, 1),
    ]
    return torch.nn.Sequential(*layers)


def main() -> None:
    shape = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank if shape == "apart" else 0)
    model: torch.nn.Module = net(dropout=shape == "dropout", norm=shape == "batchnorm")
    if shape in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dims = (2, dist.get_world_size() // 2) if shape == "hsdp" else (dist.get_world_size(),)
        names = ("replicate", "shard") if shape == "hsdp" else ("shard",)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        trained = model
    elif shape != "apart":
        trained = DDP(model)
        if shape == "compile":
            trained = torch.compile(trained, backend="aot_eager")
    else:
        trained = model
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    workers = 2 if shape == "dropout" else 0
    loader = DataLoader(Batches(rank, steps), batch_size=None, num_workers=workers)
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, as they do by default
    for x, y in loader:
        optimizer.zero_grad()
        if shape == "no_sync":
            assert isinstance(trained, DDP)
            for part in range(3):
                xs, ys = x[part * 5 : part * 5 + 5], y[part * 5 : part * 5 + 5]
                if part < 2:
                    with trained.no_sync():
                        torch.nn.functional.mse_loss(trained(xs), ys).backward()
                else:
                    torch.nn.functional.mse_loss(trained(xs), ys).backward()
        elif shape == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(trained(x).float(), y)
            loss.backward()
        else:
            torch.nn.functional.mse_loss(trained(x), y).backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
