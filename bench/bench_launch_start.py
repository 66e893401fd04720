"""Launcher start: ``steadfast launch`` -> the first training step done.

``steadfast launch --standalone --nproc-per-node 2 examples/train.py`` (gloo, CPU) is
started from a fresh interpreter, as a job script or a requeued Slurm job starts it.
Measured, per run: from just before the launcher process is started to rank 0's first
``step_done`` event, and to the launcher's exit (5 steps). Two configurations, alternated
in this run:

- ``prestart``: the default; the worker template (the process that imports torch once
  and forks the ranks) is started before the launcher imports torch itself, so the two
  imports run side by side;
- baseline ``after the agent`` (``STEADFAST_TEMPLATE_PRESTART=0``): the template starts
  when the launcher has imported torch and built its agent, as before.

    .venv/bin/python bench/bench_launch_start.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(prestart: bool, work: Path) -> tuple[float, float]:
    """(seconds to rank 0's first step, seconds to the launcher's exit)."""
    work.mkdir(parents=True)
    events = work / "events.jsonl"
    env = dict(os.environ, STEADFAST_EVENTS=str(events))
    env["STEADFAST_TEMPLATE_PRESTART"] = "1" if prestart else "0"
    cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--standalone"]
    cmd += ["--nproc-per-node=2", str(REPO / "examples" / "train.py")]
    cmd += ["--ckpt-dir", str(work / "ckpt"), "--steps", "5", "--calc-timeouts-at", "-1"]
    began = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=work)
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    steps = [
        e["time"]
        for e in map(json.loads, events.read_text().splitlines())
        if e["kind"] == "step_done" and e["rank"] == 0
    ]
    return min(steps) - began, ended - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"prestart": [], "after the agent": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):  # alternated, so that machine noise hits both
            for name in results:
                results[name].append(one_run(name == "prestart", Path(tmp) / f"{name}-{i}"))
    print(f"launcher start, 2 gloo ranks, median of {args.repeat} (max):")
    medians = {}
    for name, runs in results.items():
        first = [r[0] for r in runs]
        total = [r[1] for r in runs]
        medians[name] = statistics.median(first)
        print(
            f"  {name:<16} first step {statistics.median(first):5.2f} s ({max(first):.2f})"
            f"   launcher exit {statistics.median(total):5.2f} s ({max(total):.2f})"
        )
    ratio = medians["after the agent"] / medians["prestart"]
    saved = medians["after the agent"] - medians["prestart"]
    print(f"  prestart reaches the first step {saved:.2f} s sooner ({ratio:.2f}x faster)")


if __name__ == "__main__":
    main()
