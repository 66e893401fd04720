"""A PyTorch Lightning or Hugging Face ``Trainer`` script that imports nothing of
steadfast and uses none of its callbacks: what a user of either framework brings to
``steadfast launch`` first. 2-rank gloo DDP on CPU, a tiny model and data built here, the
framework's own checkpoints (Lightning's ``last.ckpt`` every epoch, the Trainer's
``checkpoint-N`` every 4 steps) resumed from after a restart.

    steadfast launch --nproc-per-node 2 plain_frameworks.py lightning|transformers \
        --ckpt DIR --trace FILE

Each rank writes ``step N TIME`` to ``--trace`` after each step (a test reads it live).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

STEP_SLEEP = 0.05


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g)


def lightning(ckpt: Path, trace) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            time.sleep(STEP_SLEEP)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            trace.write(f"step {self.global_step} {time.time()}\n")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_epochs=8,
        default_root_dir=str(ckpt),
        callbacks=[ModelCheckpoint(dirpath=ckpt, save_last=True, every_n_epochs=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    loader = DataLoader(TensorDataset(*data()), batch_size=8)
    trainer.fit(Net(), loader, ckpt_path="last")


def transformers(ckpt: Path, trace) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))

        def forward(self, x, labels):
            time.sleep(STEP_SLEEP)
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Trace(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trace.write(f"step {state.global_step} {time.time()}\n")

    x, y = data()
    samples = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    training = TrainingArguments(
        output_dir=str(ckpt),
        per_device_train_batch_size=8,
        num_train_epochs=8,
        learning_rate=0.05,
        optim="sgd",
        save_strategy="steps",
        save_steps=4,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    trainer = Trainer(model=Net(), args=training, train_dataset=samples, callbacks=[Trace()])
    last = get_last_checkpoint(str(ckpt)) if ckpt.exists() else None
    trainer.train(resume_from_checkpoint=last)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=["lightning", "transformers"])
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--trace", required=True)
    args = p.parse_args()
    with open(args.trace, "a", buffering=1) as trace:
        (lightning if args.framework == "lightning" else transformers)(args.ckpt, trace)


if __name__ == "__main__":
    main()
