"""The memory tier's two figures for a ``--mb`` MB state (default 1024), each against its
baseline measured in the same run:

1. the stall per snapshot (what ``CheckpointManager.snapshot`` makes training wait:
   the copy into host staging buffers; the write to ``/dev/shm`` and its CRC run in
   the background) against one plain ``memcpy`` of the state into buffers already
   allocated. Target: <= 1.2x.
2. a restore (``CheckpointManager.load``: agreement, read, CRC check, ``torch.load``)
   from the memory tier against the same load from a disk checkpoint of the same state,
   with the page cache dropped before each disk load (a restarted job reads a
   checkpoint it did not just write; root only, else the disk figure is warm and says
   so). Target: >= 10x faster.

    .venv/bin/python bench/bench_memory_tier.py [--mb 1024] [--repeats 5] [--dir DIR]

Medians of ``--repeats``; the snapshots and the memcpy are interleaved, as are the two
restores, so both sides of each ratio see the same machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from steadfast import CheckpointManager
from steadfast.checkpoint.memory import MEMORY_DIR_ENV, create_memory_dir, remove_memory_dir


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="disk checkpoint folder (default: a temp dir)")
    args = ap.parse_args()
    os.environ["STEADFAST_EVENTS"] = "off"
    memory = create_memory_dir()
    os.environ[MEMORY_DIR_ENV] = str(memory)
    disk = Path(args.dir or tempfile.mkdtemp(prefix="sf-bench-mem-", dir="/var/tmp"))
    try:
        n = args.mb * 1024 * 1024 // 4 // 16
        state = {f"layer{i}": torch.randn(n) for i in range(16)}
        floor = {k: torch.empty_like(v) for k, v in state.items()}
        mgr = CheckpointManager(disk, keep_last_n=1, memory_every=1, rng=False)
        stalls, copies = [], []
        for step in range(1, args.repeats + 2):
            for v in state.values():  # training moves on between snapshots
                v.add_(1.0)
            t0 = time.perf_counter()
            for k, v in state.items():
                floor[k].copy_(v)
            copy = time.perf_counter() - t0
            t0 = time.perf_counter()
            mgr.snapshot(step, state)
            stall = time.perf_counter() - t0
            mgr._memory.wait()  # type: ignore[union-attr]  # the write: not part of the stall
            if step > 1:  # the first snapshot allocates the staging buffers
                stalls.append(stall)
                copies.append(copy)
        mgr.save(args.repeats + 1, state)  # the disk checkpoint of the same (newest) step
        mgr.close()
        from_memory, from_disk = [], []
        cold = True
        newest = args.repeats + 1
        for _ in range(args.repeats):
            # the disk first, from a dropped page cache; then the memory tier, whose code
            # the disk load has just paged in again (dropping the cache evicts it too)
            loader = CheckpointManager(disk, memory_every=1, rng=False)
            cold = drop_caches() and cold
            t0 = time.perf_counter()
            step, loaded = loader.load(disk / f"step_{newest}")
            from_disk.append(time.perf_counter() - t0)
            assert torch.equal(loaded["layer0"], state["layer0"])
            del loaded
            t0 = time.perf_counter()
            step, loaded = loader.load()
            from_memory.append(time.perf_counter() - t0)
            assert step == newest and torch.equal(loaded["layer0"], state["layer0"])
            del loaded
            loader.close()
        stall, copy = statistics.median(stalls), statistics.median(copies)
        mem, dsk = statistics.median(from_memory), statistics.median(from_disk)
        print(f"state: {args.mb} MB in 16 tensors; medians of {args.repeats}")
        print(f"snapshot stall {stall * 1e3:8.1f} ms   memcpy {copy * 1e3:8.1f} ms   "
              f"ratio {stall / copy:.2f}x (target <= 1.2x)")  # fmt: skip
        print(f"restore: memory {mem:6.3f} s   disk ({'cold' if cold else 'warm'} cache) "
              f"{dsk:6.3f} s   memory is {dsk / mem:.1f}x faster (target >= 10x)")  # fmt: skip
    finally:
        remove_memory_dir(memory)
        if args.dir is None:
            shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
