"""A Hugging Face ``Trainer`` run for the integration tests: 2-rank gloo DDP on CPU under
``steadfast launch``, a tiny model and data built here (no download), a checkpoint every
2 steps, steadfast's callbacks, and at most one injected fault (``fail_at``, once per
run).

    steadfast launch --nproc-per-node 2 ... hf_train.py --ckpt DIR --out FILE \
        [--fault KIND --fault-rank R --fault-step K [--fault-length N]]

An in-job restart resumes from the last checkpoint (the Trainer skips the batches the
epoch already trained and restores every rank's RNG), so the final parameters equal
those of a run that never failed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from steadfast.faults import FaultKind, fail_at
from steadfast.integrations.transformers import (
    FaultToleranceCallback,
    GracefulShutdownCallback,
    NaNCallback,
    StragglerDetectionCallback,
)


class Net(torch.nn.Module):
    def __init__(self, strike, step_sleep: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.strike = strike
        self.step_sleep = step_sleep
        self.step = 0

    def forward(self, x, labels):
        loss = torch.nn.functional.mse_loss(self.net(x), labels)
        if self.strike(self.step):  # a NaN burst: this rank's gradients go NaN
            loss = loss * float("nan")
        time.sleep(self.step_sleep)
        return {"loss": loss}


class StepCounter:
    """Tells the model the Trainer's step before each one (for the fault's timing)."""

    def __init__(self, net: Net) -> None:
        from transformers import TrainerCallback

        class _Cb(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                net.step = int(state.global_step)

        self.callback = _Cb()


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
    net = Net(strike, args.step_sleep)
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    data = [{"x": xs[i], "labels": ys[i]} for i in range(len(xs))]
    training = TrainingArguments(
        output_dir=str(args.ckpt),
        per_device_train_batch_size=4,
        num_train_epochs=args.epochs,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=2,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=net,
        args=training,
        train_dataset=data,
        callbacks=[
            StepCounter(net).callback,
            FaultToleranceCallback(),
            GracefulShutdownCallback(timeout_sec=60),
            NaNCallback(action="skip", max_consecutive=3),
            *([StragglerDetectionCallback(report_time_interval=1.0)] if args.straggler else []),
        ],
    )
    last = get_last_checkpoint(str(args.ckpt)) if args.ckpt.is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in net.net.state_dict().items()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
