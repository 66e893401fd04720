"""A PyTorch Lightning run for the integration tests: 2-rank gloo DDP on CPU under
``steadfast launch``, a tiny model and data built here, a checkpoint at the end of every
(short) epoch, steadfast's FaultToleranceCallback, and at most one injected fault
(``steadfast.faults.fail_at``, once per run).

    steadfast launch --nproc-per-node 2 ... lightning_train.py --ckpt DIR --out FILE \
        [--fault KIND --fault-rank R --fault-step K]

An in-job restart resumes from the last checkpoint (``ckpt_path="last"``), and the train
loader is ``steadfast.integrations.lightning.resumable`` over a shuffling
``ResumableSampler`` (the order depends only on the epoch): a resume at an epoch's end
starts the next epoch, one after a mid-epoch save (a SIGTERM) goes on with the next
batch, so the final parameters equal those of a run that never failed. Checkpoints go
through ``SteadfastCheckpointIO`` (async); ``--corrupt-last-at K`` flips a byte of
``last.ckpt`` on rank 0 at step K (once per run), as a disk or a copy might.
"""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
import torch
from framework_run import corrupter, data, flip_target, layers, parse_args, striker
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from steadfast import ResumableSampler
from steadfast.integrations.lightning import (
    FaultToleranceCallback,
    GracefulShutdownCallback,
    NaNCallback,
    SteadfastCheckpointIO,
    StragglerDetectionCallback,
    resumable,
)
from steadfast.sdc import flip_bit


class Net(pl.LightningModule):
    def __init__(self, strike, step_sleep: float, corrupt=None) -> None:
        super().__init__()
        self.net = layers()
        self.strike = strike
        self.step_sleep = step_sleep
        self.corrupt = corrupt

    def training_step(self, batch, batch_idx):
        nan = self.strike(int(self.global_step))
        if self.corrupt is not None:
            self.corrupt(int(self.global_step))
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if nan:  # a NaN burst: the gradients go NaN on this rank
            loss = loss * float("nan")
        time.sleep(self.step_sleep)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> int:
    args = parse_args()
    strike = striker(args)

    torch.manual_seed(0)
    dataset = TensorDataset(*data())
    model = Net(strike, args.step_sleep, corrupter(args, lambda ck: ck / "last.ckpt" / "state.pt"))
    flip_target.append(lambda: flip_bit(next(model.net.parameters()), 5, 23))
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
        plugins=[SteadfastCheckpointIO(async_save=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
    )
    sampler = ResumableSampler(
        len(dataset),
        num_replicas=int(os.environ.get("WORLD_SIZE", "1")),
        rank=int(os.environ.get("RANK", "0")),
        seed=3,
    )
    loader = resumable(DataLoader(dataset, batch_size=4, sampler=sampler))
    trainer.fit(model, loader, ckpt_path="last")  # none yet: Lightning starts afresh
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.net.state_dict().items()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
