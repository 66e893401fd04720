"""Speed beside torchrun (issue 50): a script of pytorch/examples' minGPT-ddp shape
(``bench/scripts/mingpt_shape.py``: 2 DataLoader workers per rank, an evaluation pass,
AdamW, gradient clipping, a print every 50 steps, its own snapshot) under torchrun and
``steadfast launch`` (progress watching on, its default) with the same flags,
interleaved, on an idle machine and beside a neighbour that keeps every core busy.

    .venv/bin/python bench/bench_torchrun_speed.py [--runs 3] [--epochs 3] [--modes idle,busy]

Prints each mode's median wall time of each launcher and the ratio (target: <= 1.02),
and the CPU time of steadfast's own processes (the launcher with its threads, the worker
template) between the first training line and the end, as a share of one core (target:
< 1 %), beside torchrun's launcher's. The workers' progress hooks are measured by
``bench/bench_unchanged.py`` (microseconds per iteration); the progress thread is
blocked in a read.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
SCRIPT = HERE / "scripts" / "mingpt_shape.py"
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


class Own:
    """The launcher's process and its direct children that are not workers (the
    template: its children are the workers), sampled until they end."""

    def __init__(self, launcher: int, workers_are_children: bool) -> None:
        self.launcher = launcher
        self.direct_workers = workers_are_children
        self.last: dict[int, float] = {}
        self.marks: list[tuple[float, float]] = []  # (monotonic, own CPU) at mark()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _own(self) -> list[int]:
        own = [self.launcher]
        if not self.direct_workers:
            own += _children(self.launcher)
        return own

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for pid in self._own():
                value = _cpu(pid)
                if value is not None:
                    self.last[pid] = value

    def total(self) -> float:
        return sum(self.last.values())

    def mark(self) -> None:
        self.marks.append((time.monotonic(), self.total()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one(launcher: str, epochs: int) -> tuple[float, float]:
    """(wall seconds, the launcher's own CPU share of one core from the first training
    line to its end)."""
    with tempfile.TemporaryDirectory(prefix="speed-") as workdir:
        flags = ["--standalone", "--nproc-per-node=2"]
        script = [str(SCRIPT), str(epochs), str(Path(workdir) / "snapshot.pt")]
        if launcher == "torchrun":
            cmd = [str(BIN / "torchrun"), *flags, *script]
        else:
            cmd = [str(BIN / "steadfast"), "launch", "--run-dir", f"{workdir}/run", *flags, *script]
        began = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        own = Own(proc.pid, workers_are_children=launcher == "torchrun")
        assert proc.stdout is not None
        for line in proc.stdout:
            if "step 0 " in line and not own.marks:
                own.mark()
        code = proc.wait()
        wall = time.monotonic() - began
        own.mark()
        own.stop()
        if code != 0:
            raise SystemExit(f"{launcher} exited {code}")
    (t0, c0), (t1, c1) = own.marks[0], own.marks[-1]
    return wall, (c1 - c0) / max(t1 - t0, 1e-9)


def _spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--modes", default="idle,busy")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        neighbours = []
        if mode == "busy":  # every core kept busy at normal priority
            neighbours = [
                multiprocessing.Process(target=_spin, daemon=True)
                for _ in range(os.cpu_count() or 1)
            ]
            for n in neighbours:
                n.start()
        try:
            walls: dict[str, list[float]] = {"torchrun": [], "steadfast": []}
            shares: dict[str, list[float]] = {"torchrun": [], "steadfast": []}
            for _ in range(args.runs):
                for launcher in ("torchrun", "steadfast"):
                    wall, share = one(launcher, args.epochs)
                    walls[launcher].append(wall)
                    shares[launcher].append(share)
        finally:
            for n in neighbours:
                n.terminate()
                n.join()
        t, s = statistics.median(walls["torchrun"]), statistics.median(walls["steadfast"])
        print(f"{mode}: torchrun {t:.2f} s {sorted(round(w, 2) for w in walls['torchrun'])}, "
              f"steadfast {s:.2f} s {sorted(round(w, 2) for w in walls['steadfast'])}: "
              f"{s / t:.3f}x (target <= 1.02)")  # fmt: skip
        theirs, ours = (100 * statistics.median(shares[k]) for k in ("torchrun", "steadfast"))
        print(
            f"{mode}: own CPU, share of one core while training: torchrun's launcher "
            f"{theirs:.2f} %, steadfast's launcher and template {ours:.2f} % (target < 1 %)"
        )


if __name__ == "__main__":
    main()
