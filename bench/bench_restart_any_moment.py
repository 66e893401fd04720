"""A restart never waits for a preload (issue 52): a rank killed a moment after the first
step of a job that compiles, when the launcher has just asked for Inductor's compiler to
be preloaded for later workers, against the same kill in the same job uncompiled
(nothing is preloaded then), in one run.

    .venv/bin/python bench/bench_restart_any_moment.py [--repeats 3]

``tests/e2e/unchanged_train.py`` (one rank, no line of steadfast) under ``steadfast
launch``, ``--hang kill:0:8``: rank 0 SIGKILLs itself in step 8, ~0.4 s after its first
step (whose compile phase makes the launcher ask for the compiler) ended. From the
report, the restart's phases; printed per job, medians of ``--repeats`` runs: the new
worker's ``process_start`` (the launcher's spawn to the script's first line: where a
template busy importing makes the worker wait) and the restart (detection to the first
step; the compiled job's includes its warm compile), and the compiled job's
``process_start`` over the uncompiled one's (1.0: the restart did not wait).
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


def one(work: Path, compiled: bool) -> tuple[float, float]:
    """One job: its restart's (process_start, restart) seconds."""
    work.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--events", str(work / "events.jsonl"),
        "--standalone", "--nproc-per-node=1", "--max-restarts=1",
        str(SCRIPT), "--out", str(work / "out.pt"), "--snapshot", str(work / "snap.pt"),
        "--trace", str(work / "trace"), "--steps", "16", "--pace", "0.05",
        "--hang", "kill:0:8", *(["--compile"] if compiled else []),
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
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for compiled in (False, True):
                got[compiled].append(one(Path(tmp) / f"{i}-{compiled}", compiled))
    med = {c: [statistics.median(x) for x in zip(*runs, strict=True)] for c, runs in got.items()}
    for compiled, (start, restart) in med.items():
        name = "compiled (the compiler asked for)" if compiled else "uncompiled (the baseline)"
        runs = ", ".join(f"{s:.3f}" for s, _ in got[compiled])
        print(f"{name}: process_start {start:.3f} s ({runs}), restart {restart:.3f} s")
    print(f"process_start, compiled / uncompiled: {med[True][0] / med[False][0]:.2f}x")


if __name__ == "__main__":
    main()
