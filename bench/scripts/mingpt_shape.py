"""pytorch/examples' ``distributed/minGPT-ddp`` shape on CPU (issue 50's speed bench): a
small GPT trained on characters by DDP, 2 DataLoader workers per rank, AdamW, gradient
clipping, an evaluation pass per epoch, a print every few steps and its own snapshot.
No seed per rank and nothing of steadfast.

    python mingpt_shape.py EPOCHS SNAPSHOT
"""

import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BLOCK, VOCAB, WIDTH, HEADS, LAYERS = 64, 65, 128, 4, 2


class CharDataset(Dataset):
    """Windows of a fixed text (generated once, the same on every rank)."""

    def __init__(self, chars: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, VOCAB, (chars,), generator=g)

    def __len__(self) -> int:
        return len(self.data) - BLOCK - 1

    def __getitem__(self, i):
        chunk = self.data[i : i + BLOCK + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )
        mask = torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(1, BLOCK, WIDTH))
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.drop(self.tok(idx) + self.pos)
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def main(epochs: int, snapshot: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train_set, eval_set = CharDataset(20000), CharDataset(4000)
    train = DataLoader(train_set, batch_size=32, sampler=DistributedSampler(train_set),
                       num_workers=2, pin_memory=False)  # fmt: skip
    held_out = DataLoader(eval_set, batch_size=64, sampler=DistributedSampler(eval_set),
                          num_workers=2)  # fmt: skip
    model = GPT()
    first = 0
    if os.path.exists(snapshot):
        state = torch.load(snapshot)
        model.load_state_dict(state["model"])
        first = state["epochs"]
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for epoch in range(first, epochs):
        train.sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(train):
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 50 == 0:
                print(f"[rank {rank}] epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if step == 150:
                break
        model.eval()
        with torch.no_grad():
            losses = [model(x, y).item() for i, (x, y) in enumerate(held_out) if i < 20]
        if rank == 0:
            print(f"epoch {epoch} eval {sum(losses) / len(losses):.4f} ppl "
                  f"{math.exp(sum(losses) / len(losses)):.1f}", flush=True)  # fmt: skip
            torch.save({"model": model.module.state_dict(), "epochs": epoch + 1}, snapshot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
