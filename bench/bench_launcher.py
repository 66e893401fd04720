"""Launcher costs vs plain torchrun, same run: start-up, and a killed rank's way back.

    .venv/bin/python bench/bench_launcher.py [--repeats 3]

- start-up: launcher start -> the first step of 2 ranks (median);
- restart: a rank SIGKILLed at step 20 -> the first step after the in-job restart;
- step time: a 3 ms step (all-reduce + sleep) with a section per step under steadfast,
  without under torchrun.
torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, its gloo restarts
fail on torch 2.13 (stale keys in the shared store). Targets (issue 4): start-up <= 0.1 s
slower than torchrun; killed rank -> first step after restart <= 1.3 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = str(Path(__file__).with_name("_restart_worker.py"))


def run(launcher: list[str], kill: bool) -> tuple[float, float | None, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "steps")
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", STEADFAST_EVENTS="off")
        start = time.time()
        subprocess.run(
            [
                *launcher,
                "--nproc-per-node=2",
                "--max-restarts=1",
                "--monitor-interval=0.1",
                WORKER,
                out,
                "kill" if kill else "ok",
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=300,
        )
        lines = [
            line.split() for r in (0, 1) for line in Path(f"{out}.rank{r}").read_text().splitlines()
        ]
        first = min(float(t) for g, s, t in lines if g == "0" and s == "0")
        startup = first - start
        ticks = sorted(float(t) for g, s, t in lines[:40] if g == "0")  # rank 0's steps
        step = (ticks[-1] - ticks[1]) / (len(ticks) - 2)  # after the first step
        if not kill:
            return startup, None, step
        killed = min(float(t) for g, s, t in lines if g == "kill")
        back = min(float(t) for g, s, t in lines if g == "1")
        return startup, back - killed, step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    steadfast = [
        sys.executable,
        "-m",
        "steadfast.cli",
        "launch",
        "--ft-param-rank_section_timeouts=step:5",
    ]
    results: dict[str, dict[str, list[float]]] = {
        "torchrun": {"startup": [], "restart": [], "step": []},
        "steadfast": {"startup": [], "restart": [], "step": []},
    }
    for _ in range(args.repeats):  # interleaved
        for name, cmd in (("torchrun", torchrun), ("steadfast", steadfast)):
            startup, _, step = run(cmd, kill=False)
            results[name]["startup"].append(startup)
            results[name]["step"].append(step)
            _, restart, _ = run(cmd, kill=True)
            assert restart is not None
            results[name]["restart"].append(restart)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    print(
        f"start-up to first step : torchrun {med['torchrun']['startup']:.2f} s, steadfast "
        f"{med['steadfast']['startup']:.2f} s -> "
        f"{med['steadfast']['startup'] - med['torchrun']['startup']:+.2f} s "
        f"(target <= +0.1 s)"
    )
    t_step, s_step = med["torchrun"]["step"], med["steadfast"]["step"]
    print(
        f"3 ms step (all-reduce + sleep), a section per step: torchrun {1000 * t_step:.3f} ms, "
        f"steadfast {1000 * s_step:.3f} ms -> {100 * (s_step / t_step - 1):+.2f}% "
        f"(target < 0.5%)"
    )
    print(
        f"killed rank -> stepping: torchrun {med['torchrun']['restart']:.2f} s, steadfast "
        f"{med['steadfast']['restart']:.2f} s (target <= 1.3 s; median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
