"""What a memory snapshot of every step costs a training loop whose state has many
tensors: the loop's time per step with no snapshot, with the snapshot files written by
``torch.save`` (the layout before ``checkpoint/flat.py``) and in the flat layout, all
measured in the same run.

The state is a 24-layer transformer encoder and its AdamW state (1,152 tensors, 9.6 MB).
Each step is its forward, backward and optimizer step on the CPU (Python running on the
main thread, as a GPU job's main thread runs Python while it launches kernels), then
``--idle-ms`` of sleep (the host waiting for the GPU). The snapshot's write runs on the
tier's writer thread: a write that holds the GIL slows the loop even though it is in
the background, once it outlasts the idle time and overlaps the next step's Python;
``in call`` is the time the loop spends inside ``snapshot()`` itself.

    .venv/bin/python bench/bench_snapshot_many.py [--steps 40] [--idle-ms 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def _loop(mode: str, steps: int, idle: float, workdir: Path) -> tuple[float, float]:
    """Median seconds per step and in ``snapshot()``, in ``mode``."""
    import torch

    import steadfast.checkpoint.memory as memory
    from steadfast import CheckpointManager
    from steadfast.checkpoint.files import save_file
    from steadfast.checkpoint.flat import save_flat

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True)
    net = torch.nn.TransformerEncoder(layer, num_layers=24, enable_nested_tensor=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(2, 8, 64)
    memory.save_flat = save_file if mode == "torch.save" else save_flat  # type: ignore[attr-defined]
    ckpt = CheckpointManager(workdir / f"ckpt-{mode}", memory_every=1)
    state = {"model": net, "optim": opt}
    loop, in_call = [], []
    try:
        for step in range(steps):
            began = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            net(x).sum().backward()
            opt.step()
            if mode != "none":
                t0 = time.perf_counter()
                ckpt.snapshot(step + 1, state)
                in_call.append(time.perf_counter() - t0)
            time.sleep(idle)
            loop.append(time.perf_counter() - began)
    finally:
        ckpt.close()
        memory.save_flat = save_flat  # type: ignore[attr-defined]
    warm = steps // 4  # the first steps allocate the buffers and the files
    return statistics.median(loop[warm:]), statistics.median(in_call[warm:] or [0.0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--idle-ms", type=float, default=10.0)
    args = ap.parse_args()
    os.environ.setdefault("STEADFAST_EVENTS", "off")
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        os.environ["STEADFAST_MEMORY_DIR"] = shm
        rows = {m: _loop(m, args.steps, args.idle_ms / 1000, Path(tmp)) for m in
                ("none", "torch.save", "flat")}  # fmt: skip
    base = rows["none"][0]
    print(f"1,152 tensors, a snapshot every step, {args.idle_ms:g} ms idle a step (medians)")
    print(f"{'files written by':<12} {'ms/step':>9} {'/ none':>8} {'in call ms':>11}")
    for mode, (step, call) in rows.items():
        print(f"{mode:<12} {step * 1000:>9.2f} {step / base:>8.3f} {call * 1000:>11.2f}")
    cost = {m: rows[m][0] - base for m in ("torch.save", "flat")}
    print(
        f"the snapshot's cost a step: torch.save {cost['torch.save'] * 1000:.2f} ms, "
        f"flat {cost['flat'] * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
