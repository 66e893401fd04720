"""What progress watching costs an unchanged script (issue 37), beside torchrun.

    .venv/bin/python bench/bench_unchanged.py [--iterations 3000] [--runs 2]

1. **The hooks alone**: the four hooks one iteration fires (the top module's forward
   pre and post hooks, the optimizer's step pre and post hooks) called in a tight loop
   on a real probe and row: microseconds per iteration, and their share of a 100 ms
   step (target: <= 0.5 %).
2. **A training loop with and without them** in one process (an MLP of 3 x 256 units
   and Adam, on the CPU), in alternating blocks: the difference per iteration.
3. **End to end, beside torchrun in the same run**: ``tests/e2e/unchanged_train.py``
   (2 gloo ranks, DDP, Adam, a 100 ms forward) under ``torchrun`` and under
   ``steadfast launch`` (no flag), alternately ``--runs`` times each: the median step
   interval from the script's own trace, and their ratio.

No host-device sync is added: the CUDA path reads a forward's events only once
``query()`` says they completed (``tests/unit/test_progress.py`` checks it with counting
events); on this CPU-only machine there is no device to sync with.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "unchanged_train.py"
STEP = 0.100  # the step the target is stated against


def probe():
    from steadfast.monitor.table import HeartbeatTable, ask_path
    from steadfast.progress.probe import Probe

    table = HeartbeatTable.create(rows=1)
    table.reset(0, {}, None, None, None)
    p = Probe(table, 0, str(ask_path(table.path, 0)))
    p.start()
    return p, table


def hooks_alone(iterations: int) -> float:
    """Microseconds per iteration of the four hooks, on a found top module."""
    p, table = probe()
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(1, 4))  # the top module found (its hooks are per module now)
        args = ((), {})
        best = float("inf")
        for _ in range(5):
            begun = time.perf_counter()
            for _ in range(iterations):
                p._fwd_pre(model, ())
                p._fwd_post(model, (), None)
                p._opt_pre(opt, *args)
                p._opt_post(opt, *args)
            best = min(best, (time.perf_counter() - begun) / iterations)
        return best * 1e6
    finally:
        p.close()
        table.close()


def loop(iterations: int, with_hooks: bool) -> float:
    """Seconds per iteration of a small training loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 256)
    p, table = probe() if with_hooks else (None, None)
    try:
        begun = time.perf_counter()
        for _ in range(iterations):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return (time.perf_counter() - begun) / iterations
    finally:
        if p is not None:
            p.close()
            table.close()


def median_step(trace: Path) -> float:
    times: dict[int, float] = {}
    for line in trace.read_text().splitlines():
        word, *rest = line.split()
        if word == "step":
            times.setdefault(int(rest[0]), float(rest[1]))
    ordered = [times[k] for k in sorted(times)][5:]  # past the warm-up
    return statistics.median(b - a for a, b in itertools.pairwise(ordered))


def end_to_end(launcher: str, workdir: Path) -> float:
    workdir.mkdir(parents=True)
    args = [
        str(SCRIPT), "--out", str(workdir / "out.pt"), "--snapshot", str(workdir / "snap.pt"),
        "--trace", str(workdir / "trace"), "--steps", "60", "--pace", str(STEP),
        "--snapshot-every", "5",
    ]  # fmt: skip
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    else:
        cmd = [sys.executable, "-m", "steadfast.cli", "launch",
               f"--events={workdir / 'events.jsonl'}"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("STEADFAST_EVENTS", None)
    done = subprocess.run(
        [*cmd, "--nproc-per-node=2", *args], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise SystemExit(f"{launcher} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return median_step(workdir / "trace")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)

    per_iteration = hooks_alone(args.iterations)
    share = per_iteration * 1e-6 / STEP
    print(
        f"hooks alone: {per_iteration:.2f} us per iteration = {100 * share:.4f} % of a "
        f"{STEP * 1000:.0f} ms step (target <= 0.5 %: {'met' if share <= 0.005 else 'NOT met'})"
    )

    blocks: dict[bool, list[float]] = {True: [], False: []}
    loop(50, False)  # warm-up: the first optimizer's and autograd's one-time costs
    for _ in range(4):
        for with_hooks in (False, True):
            blocks[with_hooks].append(loop(args.iterations // 6, with_hooks))
    bare, hooked = min(blocks[False]), min(blocks[True])
    print(
        f"training loop: {bare * 1e6:.1f} us per iteration bare, {hooked * 1e6:.1f} us with the "
        f"hooks: {1e6 * (hooked - bare):+.1f} us ({100 * (hooked - bare) / bare:+.2f} %)"
    )

    medians: dict[str, list[float]] = {"torchrun": [], "steadfast": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for launcher in medians:
                medians[launcher].append(end_to_end(launcher, Path(tmp) / f"{launcher}{run}"))
    torchrun, steadfast = (
        statistics.median(medians["torchrun"]),
        statistics.median(medians["steadfast"]),
    )
    print(
        f"end to end (2 ranks, DDP, {STEP * 1000:.0f} ms forward): median step "
        f"{torchrun * 1000:.2f} ms under torchrun, {steadfast * 1000:.2f} ms under steadfast "
        f"launch: ratio {steadfast / torchrun:.4f}"
    )


if __name__ == "__main__":
    main()
