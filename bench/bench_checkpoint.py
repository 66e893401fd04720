"""Checkpoint speed for a ~200 MB state: sync save, async stall, load, vs plain torch.save.

    .venv/bin/python bench/bench_checkpoint.py [--mb 200] [--dir /tmp/sf-bench]

Prints each figure and its ratio to a plain ``torch.save`` (+ fsync) of the same state to
the same disk, measured in the same run. Targets (issue 3): async stall <= 10% of the sync
save time; atomic+checksummed save overhead <= 15% over plain torch.save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from steadfast import CheckpointManager


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--dir", default="/tmp/sf-bench")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    n = args.mb * 1024 * 1024 // 4
    state = {f"layer{i}": torch.randn(n // 8) for i in range(8)}

    def plain() -> None:
        path = base / "plain.pt"
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())

    sync_mgr = CheckpointManager(base / "sync", keep_last_n=2)
    async_mgr = CheckpointManager(base / "async", keep_last_n=2, async_save=True)
    step = iter(range(1, 1000))
    t_plain = timed(plain, args.repeats)
    t_sync = timed(lambda: sync_mgr.save(next(step), state), args.repeats)
    stalls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        async_mgr.save(next(step), state)
        stalls.append(time.perf_counter() - t0)
        async_mgr.wait()
    t_stall = statistics.median(stalls)
    t_load = timed(lambda: sync_mgr.load(), args.repeats)
    t_plain_load = timed(lambda: torch.load(base / "plain.pt", weights_only=True), args.repeats)
    mb = args.mb
    print(f"state: {mb} MB in 8 tensors; median of {args.repeats}; dir {base}")
    print(f"plain torch.save+fsync : {t_plain:7.3f} s  {mb / t_plain:7.0f} MB/s  (baseline)")
    print(
        f"sync save (atomic+crc) : {t_sync:7.3f} s  {mb / t_sync:7.0f} MB/s  "
        f"overhead {100 * (t_sync / t_plain - 1):+.1f}% (target <= +15%)"
    )
    print(
        f"async save stall       : {t_stall:7.3f} s  = {100 * t_stall / t_sync:.1f}% of sync "
        f"(target <= 10%)"
    )
    print(
        f"verified load          : {t_load:7.3f} s  {mb / t_load:7.0f} MB/s  "
        f"vs plain torch.load {t_plain_load:.3f} s ({t_load / t_plain_load:.2f}x)"
    )
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
