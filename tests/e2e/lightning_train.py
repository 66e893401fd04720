"""A PyTorch Lightning run for the integration tests: 2-rank gloo DDP on CPU under
``steadfast launch``, a tiny model and data built here, a checkpoint at the end of every
(short) epoch, steadfast's FaultToleranceCallback, and at most one injected fault
(``steadfast.faults.fail_at``, once per run).

    steadfast launch --nproc-per-node 2 ... lightning_train.py --ckpt DIR --out FILE \
        [--fault KIND --fault-rank R --fault-step K]

An in-job restart resumes from the last checkpoint (``ckpt_path="last"``): the epoch
replays from its start with the same batches (the data and its order depend only on the
epoch), so the final parameters equal those of a run that never failed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from steadfast.faults import FaultKind, fail_at
from steadfast.integrations.lightning import (
    FaultToleranceCallback,
    GracefulShutdownCallback,
    NaNCallback,
    StragglerDetectionCallback,
)


class Net(pl.LightningModule):
    def __init__(self, strike, step_sleep: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.strike = strike
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):
        nan = self.strike(int(self.global_step))
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if nan:  # a NaN burst: the gradients go NaN on this rank
            loss = loss * float("nan")
        time.sleep(self.step_sleep)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--fault", choices=[k.value for k in FaultKind], default=None)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=5)
    ap.add_argument("--fault-length", type=int, default=1, help="steps a fault lasts")
    ap.add_argument("--fault-seconds", type=float, default=0.0, help="a slow step's extra")
    ap.add_argument("--straggler", action="store_true", help="with straggler reports (1 s)")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    fault = (
        fail_at(
            args.fault_rank,
            args.fault_step,
            args.fault,
            once_dir=args.ckpt.parent / "faults",
            **(
                {"length": args.fault_length, "seconds": args.fault_seconds}
                if args.fault in (FaultKind.NAN_BURST.value, FaultKind.SLOW_RANK.value)
                else {}
            ),
        )
        if args.fault
        else None
    )

    def strike(step: int) -> bool:
        """The fault, if it strikes now; True while a NaN burst lasts."""
        hit = fault is not None and fault.check(step, rank)
        if hit and args.fault == FaultKind.SLOW_RANK.value:  # a slow GPU: its forward
            time.sleep(args.fault_seconds)
        return bool(hit) and args.fault == FaultKind.NAN_BURST.value

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    model = Net(strike, args.step_sleep)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
        // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_epochs=args.epochs,
        default_root_dir=str(args.ckpt),
        callbacks=[
            FaultToleranceCallback(autoresume=False, calculate_timeouts=True, exp_dir=args.ckpt),
            GracefulShutdownCallback(timeout_sec=60),
            NaNCallback(action="skip", max_consecutive=3),
            ModelCheckpoint(dirpath=args.ckpt, save_last=True, save_top_k=-1, every_n_epochs=1),
            *(
                [
                    StragglerDetectionCallback(
                        report_time_interval=1.0,
                        calc_relative_gpu_perf=True,
                        calc_individual_gpu_perf=True,
                        num_gpu_perf_scores_to_print=2,
                        gpu_relative_perf_threshold=0.7,
                        gpu_individual_perf_threshold=0.7,
                        stop_if_detected=False,
                        enable_ptl_logging=False,
                    )
                ]
                if args.straggler
                else []
            ),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
    )
    last = args.ckpt / "last.ckpt"
    trainer.fit(
        model, DataLoader(data, batch_size=4), ckpt_path=str(last) if last.exists() else None
    )
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.net.state_dict().items()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
