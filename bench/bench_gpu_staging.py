"""The memory tier's staging of a state that lives on the GPU: what a snapshot makes the
host wait for, against the copy itself, and whether it synchronised the device.

    .venv/bin/python bench/bench_gpu_staging.py [--mb 1024] [--repeats 5] [--device cuda]
        [--json PATH]

A one-rank group holds ``--mb`` MB of float32 in 16 buffers of a module (as DDP keeps a
model). ``CheckpointManager(memory_every=1).snapshot`` copies it into host staging
buffers; the write to ``/dev/shm`` and its CRC run in the background. Each round, after
one warm-up that allocates the staging buffers, interleaved:

1. **memcpy**: the same bytes copied device -> pinned host memory, waited for (the
   floor: what any snapshot must move);
2. **stall**: how long ``snapshot()`` holds the host (on CUDA the copy is queued on the
   stream: the stall is its launch), and **landed**: when the copy was done on the
   device (a synchronize after the call);
3. **synchronised?**: ``snapshot()`` called with :data:`BUSY_MS` of work queued ahead of
   it on the stream (``torch.cuda._sleep``): a snapshot that waits for the device holds
   the host that long; one that does not returns in about its plain stall;
4. **right**: the newest snapshot, read back from the memory tier, equals the state
   (bit for bit) at the step it was taken, though training moved on after it.

On ``--device cpu`` there is no stream: the stall is the copy, and 3 is not measured.
Medians are printed with the ratio of the stall to the memcpy; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sfgpu import one_rank_group, snapshot_rounds, spin_cycles
from steadfast import CheckpointManager
from steadfast.checkpoint.memory import MEMORY_DIR_ENV, create_memory_dir, remove_memory_dir

#: milliseconds of work queued on the stream ahead of the snapshot in check 3
BUSY_MS = 200.0


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def measure(mb: int, repeats: int, device: str) -> dict[str, Any]:
    """The figures (seconds, and the verdicts) for one state of ``mb`` MB on ``device``."""
    memory = create_memory_dir()
    os.environ[MEMORY_DIR_ENV] = str(memory)
    disk = Path(tempfile.mkdtemp(prefix="sf-bench-gpu-staging-"))
    try:
        n = mb * 1024 * 1024 // 4 // 16
        module = torch.nn.Module()
        for i in range(16):
            module.register_buffer(f"layer{i}", torch.randn(n, device=device))
        tensors = dict(module.named_buffers())
        state = {"model": module}
        mgr = CheckpointManager(disk, keep_last_n=1, memory_every=1, rng=False)
        stalls, lands, copies = snapshot_rounds(mgr, state, tensors, repeats, device)
        busy_stall = None
        if device != "cpu":
            cycles = spin_cycles(BUSY_MS)
            for v in tensors.values():
                v.add_(1.0)
            torch.cuda._sleep(cycles)  # queued ahead of the snapshot's copy
            t0 = time.perf_counter()
            mgr.snapshot(repeats + 2, state)
            busy_stall = time.perf_counter() - t0
            _sync(device)
            mgr._memory.wait()  # type: ignore[union-attr]
        taken = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        newest = repeats + 2 if device != "cpu" else repeats + 1
        for v in tensors.values():  # training moves on: the snapshot must not
            v.add_(1.0)
        _sync(device)
        mgr.close()
        right = _restored(disk, taken, newest)
    finally:
        remove_memory_dir(memory)
        with contextlib.suppress(OSError):
            for p in sorted(disk.rglob("*"), reverse=True):
                p.unlink() if p.is_file() or p.is_symlink() else p.rmdir()
            disk.rmdir()
    stall, copy, land = (statistics.median(x) for x in (stalls, copies, lands))
    return {
        "device": device if device == "cpu" else f"cuda ({torch.cuda.get_device_name()})",
        "mb": mb,
        "repeats": repeats,
        "stall_s": stall,
        "memcpy_s": copy,
        "landed_s": land,
        "stall_over_memcpy": stall / copy if copy else None,
        "busy_ms": BUSY_MS if busy_stall is not None else None,
        "busy_stall_s": busy_stall,
        "synchronised": None if busy_stall is None else busy_stall > 0.5 * BUSY_MS / 1e3,
        "right": right,
    }


def _restored(disk: Path, taken: dict[str, torch.Tensor], newest: int) -> bool:
    """The newest snapshot (step ``newest``), restored from the memory tier by a new
    manager into a fresh module, equals ``taken``."""
    module = torch.nn.Module()
    for k, v in taken.items():
        module.register_buffer(k, torch.zeros_like(v))
    loader = CheckpointManager(disk, memory_every=1, rng=False, max_proof_steps=0)
    try:
        got = loader.restore({"model": module})
    finally:
        loader.close()
    return (
        got is not None
        and got[0] == newest
        and all(torch.equal(getattr(module, k).cpu(), v) for k, v in taken.items())
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    with one_rank_group(args.device):
        got = measure(args.mb, args.repeats, args.device)
    print(f"state on {got['device']}: {args.mb} MB in 16 buffers; medians of {args.repeats}")
    stall, copy = got["stall_s"] * 1e3, got["memcpy_s"] * 1e3
    print(f"  snapshot stall {stall:8.2f} ms   memcpy {copy:8.2f} ms   "
          f"{got['stall_over_memcpy']:.3f}x the memcpy")  # fmt: skip
    print(f"  the copy landed after {got['landed_s'] * 1e3:8.2f} ms "
          f"({got['landed_s'] / got['memcpy_s']:.2f}x the memcpy)")  # fmt: skip
    if got["busy_stall_s"] is not None:
        print(
            f"  with {BUSY_MS:.0f} ms queued ahead: stall {got['busy_stall_s'] * 1e3:8.2f} ms: "
            + ("SYNCHRONISED the device" if got["synchronised"] else "did not synchronise")
        )
    print(f"  the snapshot read back equals the state at its step: {got['right']}")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
