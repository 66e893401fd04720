"""How long a launcher outlives its workers: the last worker's exit -> the launcher's exit.

A plain torchrun script (``tests/multinode/plain_ddp.py``: DDP on gloo, no steadfast
import), 2 workers on this node, 3 short epochs, under ``steadfast launch`` and under
``torchrun`` (the baseline), in the same run. Measured per run: from the last worker's
exit (the script's ``done`` line, written just before ``destroy_process_group``, so the
figure includes the worker's own teardown) to the launcher process's exit as its parent
sees it. On Slurm this is the tail every job step pays before the allocation is free.

    .venv/bin/python bench/bench_launcher_end.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "multinode" / "plain_ddp.py"


def run_once(launcher: list[str], tmp: Path, port: int) -> float:
    trace = tmp / f"trace-{time.monotonic_ns()}"
    args = [
        *launcher,
        "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        str(SCRIPT), "--snapshot", str(trace / "snapshot.pt"), "--epochs", "3",
        "--epoch-sleep", "0.05", "--out", str(trace / "out.pt"), "--trace", str(trace),
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.wait(timeout=300)
    ended = time.time()
    assert proc.returncode == 0, f"{launcher[0]} exited {proc.returncode}"
    done = [
        float(line.split()[-1])
        for f in trace.iterdir()
        if f.name.startswith("rank")
        for line in f.read_text().splitlines()
        if line.startswith("done")
    ]
    return ended - max(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    bindir = Path(sys.executable).parent
    launchers = {
        "steadfast launch": [sys.executable, "-m", "steadfast.cli", "launch"],
        "torchrun (baseline)": [str(bindir / "torchrun")],
    }
    medians = {}
    with tempfile.TemporaryDirectory() as d:
        for i, (name, cmd) in enumerate(launchers.items()):
            got = [run_once(cmd, Path(d), 29720 + i) for _ in range(args.repeat)]
            medians[name] = statistics.median(got)
            print(
                f"{name:22s} last worker exit -> launcher exit: median {medians[name]:.3f} s, "
                f"max {max(got):.3f} s ({args.repeat} runs)",
                flush=True,
            )
    ours, base = medians["steadfast launch"], medians["torchrun (baseline)"]
    print(f"\nsteadfast launch ends {base / ours:.1f}x sooner after its workers than torchrun")


if __name__ == "__main__":
    main()
