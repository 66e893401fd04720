"""Clean ends (issue 50): fault-free runs of three scripts users bring, under
``steadfast launch`` and torchrun in turn, counting every run that did not end with
exit 0 within 2x torchrun's median time, the runs trained more than once, and the
teardown warnings (``worker_teardown``).

    .venv/bin/python bench/bench_clean_ends.py [--runs 50] [--scripts readme,multinode,loader]

The scripts (``bench/scripts/``): the README's first one (DDP alive at
``destroy_process_group()``, module level); pytorch/examples' ``multinode.py`` on CPU
(``ddp_tutorial.py``: ``main()`` holds its Trainer, a DistributedSampler, snapshots,
launched with torchrun's ``--rdzv-backend c10d``); a DDP script with DataLoader workers
and an evaluation pass. 2 gloo ranks on one host, ``--max-restarts 2`` for both
launchers (so a finished script that is trained again shows as a second
``workers_started``). The goal: 0 bad ends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _script(name: str, workdir: Path) -> tuple[list[str], list[str]]:
    """(launcher flags, script and its arguments) of a bench script."""
    if name == "readme":
        return ["--standalone"], [str(HERE / "scripts" / "readme_ddp.py")]
    if name == "multinode":
        flags = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_port()}"]
        # the tutorial as users copy it; its snapshot.pt lands in the run's folder (cwd)
        return flags, [str(HERE / "scripts" / "ddp_tutorial.py"), "6", "2"]
    if name == "loader":
        return ["--standalone"], [str(HERE / "scripts" / "loader_eval.py")]
    raise SystemExit(f"unknown script {name!r}: readme, multinode or loader")


def one(name: str, launcher: str, limit: float) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix=f"clean-{name}-"))
    try:
        flags, script = _script(name, workdir)
        common = ["--nproc-per-node=2", "--max-restarts=2", *flags]
        if launcher == "torchrun":
            cmd = [str(BIN / "torchrun"), *common, *script]
        else:
            cmd = [
                str(BIN / "steadfast"),
                "launch",
                f"--run-dir={workdir / 'run'}",
                *common,
                *script,
            ]
        began = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=workdir, capture_output=True, timeout=limit)
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            code = None  # never ended within the limit (killed with its process group)
        took = time.monotonic() - began
        kinds: list[str] = []
        log = workdir / "run" / "events.jsonl"
        if log.exists():
            kinds = [json.loads(line)["kind"] for line in log.read_text().splitlines() if line]
        return {
            "code": code,
            "seconds": took,
            "trainings": max(1, kinds.count("workers_started")),
            "teardowns": kinds.count("worker_teardown"),
            "hangs": kinds.count("hang_confirmed") + kinds.count("rank_hung"),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--scripts", default="readme,multinode,loader")
    args = parser.parse_args()
    bad_total = 0
    print(f"{'script':<10} {'launcher':<9} {'runs':>4} {'exit0':>5} {'bad end':>7} "
          f"{'retrained':>9} {'teardown':>8} {'median s':>8} {'max s':>6}")  # fmt: skip
    for name in args.scripts.split(","):
        results: dict[str, list[dict[str, object]]] = {"torchrun": [], "steadfast": []}
        for i in range(args.runs):  # interleaved: both see the same machine
            for launcher in ("torchrun", "steadfast"):
                results[launcher].append(one(name, launcher, limit=180))
            print(f"  {name}: {i + 1}/{args.runs}", end="\r", file=sys.stderr, flush=True)
        base = statistics.median(float(r["seconds"]) for r in results["torchrun"])  # type: ignore[arg-type]
        for launcher, runs in results.items():
            seconds = [float(r["seconds"]) for r in runs]  # type: ignore[arg-type]
            ok = [r for r in runs if r["code"] == 0]
            bad = [r for r in runs if r["code"] != 0 or float(r["seconds"]) > 2 * base]  # type: ignore[arg-type]
            retrained = sum(1 for r in runs if int(r["trainings"]) > 1)  # type: ignore[call-overload]
            teardowns = sum(int(r["teardowns"]) for r in runs)  # type: ignore[call-overload]
            if launcher == "steadfast":
                bad_total += len(bad)
            print(
                f"{name:<10} {launcher:<9} {len(runs):>4} {len(ok):>5} {len(bad):>7} "
                f"{retrained:>9} {teardowns:>8} {statistics.median(seconds):>8.2f} "
                f"{max(seconds):>6.1f}"
            )
        ratio = statistics.median(float(r["seconds"]) for r in results["steadfast"]) / base  # type: ignore[arg-type]
        print(f"{name:<10} steadfast / torchrun median time: {ratio:.3f}x")
    print(f"steadfast runs that did not end with exit 0 within 2x torchrun's median: {bad_total}")


if __name__ == "__main__":
    main()
