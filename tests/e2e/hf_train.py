"""A Hugging Face ``Trainer`` run for the integration tests: 2-rank gloo DDP on CPU under
``steadfast launch``, a tiny model and data built here (no download), a checkpoint every
2 steps, steadfast's callbacks, and at most one injected fault (``fail_at``, once per
run).

    steadfast launch --nproc-per-node 2 ... hf_train.py --ckpt DIR --out FILE \
        [--fault KIND --fault-rank R --fault-step K [--fault-length N]]

An in-job restart resumes from the newest verified checkpoint (``last_verified_checkpoint``;
the Trainer skips the batches the epoch already trained and restores every rank's RNG),
so the final parameters equal those of a run that never failed. ``--corrupt-last-at K``
flips a byte of the newest checkpoint's model file on rank 0 at step K (once per run).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from framework_run import corrupter, data, layers, parse_args, striker
from transformers import Trainer, TrainingArguments

from steadfast.integrations.transformers import (
    FaultToleranceCallback,
    GracefulShutdownCallback,
    NaNCallback,
    StragglerDetectionCallback,
    VerifiedCheckpointCallback,
    last_verified_checkpoint,
)


class Net(torch.nn.Module):
    def __init__(self, strike, step_sleep: float, corrupt=None) -> None:
        super().__init__()
        self.net = layers()
        self.strike = strike
        self.step_sleep = step_sleep
        self.corrupt = corrupt
        self.step = 0

    def forward(self, x, labels):
        if self.corrupt is not None:
            self.corrupt(self.step)
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


def _newest_model_file(ckpt: Path) -> Path:
    newest = max(ckpt.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return max((f for f in newest.iterdir() if f.suffix in (".safetensors", ".bin")),
               key=lambda f: f.stat().st_size)  # fmt: skip


def main() -> int:
    args = parse_args()
    strike = striker(args)

    torch.manual_seed(0)
    net = Net(strike, args.step_sleep, corrupter(args, _newest_model_file))
    xs, ys = data()
    samples = [{"x": xs[i], "labels": ys[i]} for i in range(len(xs))]
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
        train_dataset=samples,
        callbacks=[
            StepCounter(net).callback,
            FaultToleranceCallback(),
            GracefulShutdownCallback(timeout_sec=60),
            NaNCallback(action="skip", max_consecutive=3),
            VerifiedCheckpointCallback(),
            *([StragglerDetectionCallback(report_time_interval=1.0)] if args.straggler else []),
        ],
    )
    trainer.train(resume_from_checkpoint=last_verified_checkpoint(args.ckpt))
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in net.net.state_dict().items()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
