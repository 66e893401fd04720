"""Does a restart wait for a preload (issue 52)? A rank killed at several moments after
the first step of a job that compiles (the launcher then has the worker template import
Inductor's compiler for later workers, seconds during which it forks no worker), against
the same kill in the same job uncompiled (nothing is preloaded then), in one run.

    .venv/bin/python bench/bench_restart_any_moment.py [--repeats 2] [--at 2 6 12]

``tests/e2e/unchanged_train.py`` (one rank, no line of steadfast) under ``steadfast
launch``, steps of 50 ms, ``--hang kill:0:S``: rank 0 SIGKILLs itself in step S, about
S x 50 ms after its first step. From the report, the restart's phases; printed per kill
step and job, medians of ``--repeats`` runs: the new worker's ``process_start`` (the
launcher's spawn to the script's first line: where a template busy importing makes the
worker wait) and the restart (detection to the first step; the compiled job's holds its
warm compile, and the compiler's import where the template has not preloaded it yet),
and the compiled job's ``process_start`` over the uncompiled one's (1.0: no wait).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "e2e" / "unchanged_train.py"

from steadfast.report import compute_report, load_events  # noqa: E402


def one(work: Path, compiled: bool, at: int) -> tuple[float, float]:
    """One job killed in step ``at``: its restart's (process_start, restart) seconds."""
    work.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--events", str(work / "events.jsonl"),
        "--standalone", "--nproc-per-node=1", "--max-restarts=1",
        str(SCRIPT), "--out", str(work / "out.pt"), "--snapshot", str(work / "snap.pt"),
        "--trace", str(work / "trace"), "--steps", str(at + 8), "--pace", "0.05",
        "--hang", f"kill:0:{at}", *(["--compile"] if compiled else []),
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(work)}  # a compile cache of its own
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    evs, _ = load_events(work / "events.jsonl")
    [restart] = compute_report(evs).restarts_phases
    phases = restart["phases"]
    return phases["process_start"], sum(v for k, v in phases.items() if k != "detection")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--at", type=int, nargs="+", default=[2, 6, 12], help="kill steps")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for at in args.at:
            got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for i in range(args.repeats):
                for compiled in (False, True):
                    got[compiled].append(one(Path(tmp) / f"{at}-{i}-{compiled}", compiled, at))
            med = {c: [statistics.median(x) for x in zip(*r, strict=True)] for c, r in got.items()}
            print(f"killed in step {at}:")
            for compiled, (start, restart) in med.items():
                name = "compiled  " if compiled else "uncompiled"
                runs = ", ".join(f"{s:.3f}" for s, _ in got[compiled])
                print(f"  {name}: process_start {start:.3f} s ({runs}), restart {restart:.3f} s")
            print(f"  process_start, compiled / uncompiled: {med[True][0] / med[False][0]:.2f}x")


if __name__ == "__main__":
    main()
