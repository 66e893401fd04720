"""What lightning_train.py and hf_train.py share: their command line, the one injected
fault (``fail_at``, once per run) and the step callable that applies it, and the data
(32 samples of 8 features, the same in every run)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from steadfast.faults import FaultKind, fail_at


def parse_args() -> argparse.Namespace:
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
    ap.add_argument(
        "--corrupt-last-at", type=int, default=None, help="flip a byte of the newest checkpoint"
    )
    return ap.parse_args()


#: what a ``bit_flip`` fault flips, set by the script once its model exists
flip_target: list[Callable[[], None]] = []


def striker(args: argparse.Namespace) -> Callable[[int], bool]:
    """``strike(step)``: the fault, if it strikes at ``step`` on this rank (a slow rank
    sleeps here, in the forward); True while a NaN burst lasts."""
    rank = int(os.environ.get("RANK", "0"))
    lasting = args.fault in (FaultKind.NAN_BURST.value, FaultKind.SLOW_RANK.value)
    fault = (
        fail_at(
            args.fault_rank,
            args.fault_step,
            args.fault,
            once_dir=args.ckpt.parent / "faults",
            **({"length": args.fault_length, "seconds": args.fault_seconds} if lasting else {}),
        )
        if args.fault
        else None
    )

    def strike(step: int) -> bool:
        hit = fault is not None and fault.check(step, rank)
        if hit and args.fault == FaultKind.SLOW_RANK.value:  # a slow GPU: its forward
            time.sleep(args.fault_seconds)
        if hit and args.fault == FaultKind.BIT_FLIP.value:  # bad memory: a weight's bit
            for flip in flip_target:
                flip()
        return bool(hit) and args.fault == FaultKind.NAN_BURST.value

    return strike


def corrupter(
    args: argparse.Namespace, newest: Callable[[Path], Path]
) -> Callable[[int], None] | None:
    """``corrupt(step)``: at step ``--corrupt-last-at`` on rank 0, once per run, one byte
    flipped in place in the file ``newest(ckpt_dir)`` of the newest checkpoint (its size
    unchanged), as a disk or a copy might."""
    once = args.ckpt.parent / "corrupted"
    at = args.corrupt_last_at
    if at is None or os.environ.get("RANK", "0") != "0" or once.exists():
        return None

    def corrupt(step: int) -> None:
        if step != at or once.exists():
            return
        once.touch()
        target = newest(args.ckpt)
        with open(target, "r+b") as fh:
            fh.seek(target.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))

    return corrupt


def layers() -> torch.nn.Module:
    """The tiny model both frameworks train (each wraps it in its own module)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
