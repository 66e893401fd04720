"""Checkpoint speed for a ~200 MB state: sync save, async stall, load, vs plain torch.save.

    .venv/bin/python bench/bench_checkpoint.py [--mb 200] [--repeats 7] [--dir /tmp/sf-bench]

The baseline is a plain ``torch.save`` + ``fsync`` of the same state to a new file on the
same disk, measured in the same run and interleaved with the manager's saves (plain, sync,
plain, sync, ...) so both see the same page-cache and disk conditions; both keep the same
number of files on disk. Targets (issue 3): atomic + checksummed save overhead <= 15% over
plain torch.save; async stall <= 10% of the sync save time.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--dir", default="/tmp/sf-bench")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    keep = 2
    n = args.mb * 1024 * 1024 // 4
    state = {f"layer{i}": torch.randn(n // 8) for i in range(8)}

    def plain(i: int) -> None:
        with open(base / f"plain_{i}.pt", "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())

    sync_mgr = CheckpointManager(base / "sync", keep_last_n=keep)
    async_mgr = CheckpointManager(base / "async", keep_last_n=keep, async_save=True)
    t_plain, t_sync, t_stall, t_async_total = [], [], [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        plain(i)
        t_plain.append(time.perf_counter() - t0)
        (base / f"plain_{i - keep}.pt").unlink(missing_ok=True)  # same files kept as the manager

        t0 = time.perf_counter()
        sync_mgr.save(i, state)
        t_sync.append(time.perf_counter() - t0)
        sync_mgr.wait()  # old checkpoints are unlinked in the background: not in the next figure

        t0 = time.perf_counter()
        async_mgr.save(i, state)
        t_stall.append(time.perf_counter() - t0)
        async_mgr.wait()
        t_async_total.append(time.perf_counter() - t0)

    def load_plain() -> float:
        t0 = time.perf_counter()
        torch.load(base / f"plain_{args.repeats - 1}.pt", weights_only=True)
        return time.perf_counter() - t0

    def load_mgr() -> float:
        t0 = time.perf_counter()
        sync_mgr.load()
        return time.perf_counter() - t0

    t_plain_load = [load_plain() for _ in range(3)]
    t_load = [load_mgr() for _ in range(3)]
    med = statistics.median
    if os.environ.get("BENCH_VERBOSE"):
        for name, xs in [("plain", t_plain), ("sync", t_sync), ("stall", t_stall)]:
            print(name, " ".join(f"{x:.3f}" for x in xs))
    plain_s, sync_s, stall_s = med(t_plain), med(t_sync), med(t_stall)
    mb = args.mb
    print(f"state: {mb} MB in 8 tensors; median of {args.repeats} interleaved runs; dir {base}")
    print(f"plain torch.save+fsync : {plain_s:7.3f} s  {mb / plain_s:6.0f} MB/s  (baseline)")
    print(
        f"sync save (atomic+crc) : {sync_s:7.3f} s  {mb / sync_s:6.0f} MB/s  "
        f"overhead {100 * (sync_s / plain_s - 1):+.1f}% (target <= +15%)"
    )
    print(
        f"async save stall       : {stall_s:7.3f} s  = {100 * stall_s / sync_s:.1f}% of sync "
        f"(target <= 10%); save+wait {med(t_async_total):.3f} s"
    )
    print(
        f"verified load          : {med(t_load):7.3f} s  {mb / med(t_load):6.0f} MB/s  "
        f"vs plain torch.load {med(t_plain_load):.3f} s "
        f"({med(t_load) / med(t_plain_load):.2f}x)"
    )
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
