"""What progress watching costs an unchanged script (issue 37), beside torchrun.

    .venv/bin/python bench/bench_unchanged.py [--iterations 3000] [--runs 2]

1. **The hooks alone**: the four hooks one iteration fires (the top module's forward
   pre and post hooks, the optimizer's step pre and post hooks) called in a tight loop
   on a real probe and row: microseconds per iteration, and their share of a 100 ms
   step (target: <= 0.5 %).
   (A training loop timed with and without them in one process varied by +-15 % from
   block to block on this shared machine: far above a few microseconds.)
2. **End to end, beside torchrun in the same run**: ``tests/e2e/unchanged_train.py``
   (2 gloo ranks, DDP, Adam, a 100 ms forward) under ``torchrun``, ``steadfast launch``
   (no flag) and ``steadfast launch --ft-watch-progress false``, in turn ``--runs``
   times each: the median step interval from the script's own trace, and the ratios
   (the last isolates the hooks from the rest of the launcher; this machine's noise
   between runs is ~0.5 ms a step).

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
        cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--max-restarts=2",
               f"--events={workdir / 'events.jsonl'}"]  # fmt: skip
        if launcher == "steadfast, hooks off":
            cmd += ["--ft-watch-progress", "false"]
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
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    per_iteration = hooks_alone(args.iterations)
    share = per_iteration * 1e-6 / STEP
    print(
        f"hooks alone: {per_iteration:.2f} us per iteration = {100 * share:.4f} % of a "
        f"{STEP * 1000:.0f} ms step (target <= 0.5 %: {'met' if share <= 0.005 else 'NOT met'})"
    )

    names = ("torchrun", "steadfast", "steadfast, hooks off")
    medians: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for i, launcher in enumerate(names):
                medians[launcher].append(end_to_end(launcher, Path(tmp) / f"{i}-{run}"))
    step = {name: statistics.median(values) for name, values in medians.items()}
    print(
        f"end to end (2 ranks, DDP, {STEP * 1000:.0f} ms forward), median step: "
        + ", ".join(f"{name} {value * 1000:.2f} ms" for name, value in step.items())
    )
    on, off = step["steadfast"], step["steadfast, hooks off"]
    print(
        f"  steadfast / torchrun {on / step['torchrun']:.4f}; the hooks alone: steadfast / "
        f"steadfast with them off {on / off:.4f}"
    )


if __name__ == "__main__":
    main()
