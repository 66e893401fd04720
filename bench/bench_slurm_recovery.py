"""How long a multi-node Slurm job takes to get its ranks training again after a node is
lost, with a spare in the allocation and without, read from the event logs of
``tests/slurm/test_slurm_nodes.py``'s runs on the bed's cluster:

    .venv/bin/python bench/bench_slurm_recovery.py            # runs those tests first
    .venv/bin/python bench/bench_slurm_recovery.py /tmp/sfslurm  # a session's --basetemp

Each figure runs from the last step done before the fault was seen (the node was
powered off just after it) to its detection, steadfast's requeue, and the first
training process started after it. The baseline is the spare: a requeue's restart
time is printed as a multiple of the spare's, measured in the same test session.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: test folder (pytest names it from the test's name) -> the events that see its fault
RUNS = {
    "spare takes over": ("test_a_lost_node_with_a_spare_0", ("node_lost",)),
    "node lost, requeued away from it": ("test_a_lost_node_requeues_the_0", ("node_lost",)),
    "first node lost, Slurm requeues": (
        "test_the_first_node_lost_slurm0",
        ("node_isolated", "rank_failed"),
    ),
    "exit 16, requeued away from the node": (
        "test_exit_16_moves_the_doubted0",
        ("rerun_elsewhere",),
    ),
}


def _events(path: Path) -> list[dict[str, Any]]:
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def measure(run: Path, kinds: tuple[str, ...]) -> dict[str, float | None]:
    """Seconds from the last step before the fault's detection to the detection, the
    requeue (None if steadfast made none) and the first process started after it."""
    evs = _events(run / "run" / "events.jsonl")
    seen = next(e for e in evs if e["kind"] in kinds)
    last = max(e["time"] for e in evs if e["kind"] == "step_done" and e["time"] < seen["time"])
    requeue = next((e["time"] for e in evs if e["kind"] == "job_requeued"), None)
    start = next(e["time"] for e in evs if e["kind"] == "job_start" and e["time"] > seen["time"])
    return {
        "detected": seen["time"] - last,
        "requeued": None if requeue is None else requeue - last,
        "restarted": start - last,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "basetemp", type=Path, nargs="?", help="pytest's --basetemp of a session that ran them"
    )
    args = ap.parse_args()
    if args.basetemp is None:  # run the tests now (Slurm and the bed, as make test has)
        args.basetemp = Path(tempfile.mkdtemp(prefix="sf-slurm-bench-"))
        tests = Path(__file__).resolve().parents[1] / "tests" / "slurm" / "test_slurm_nodes.py"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
             "-k", "lost or exit_16", f"--basetemp={args.basetemp}"],
            check=False,
        )  # fmt: skip
    figures = {}
    for label, (folder, kinds) in RUNS.items():
        run = args.basetemp / folder
        if not (run / "run" / "events.jsonl").exists():
            print(f"{label:40s} no run in {run}")
            continue
        figures[label] = measure(run, kinds)
    baseline = figures.get("spare takes over", {}).get("restarted")
    for label, f in figures.items():
        requeued = "-" if f["requeued"] is None else f"{f['requeued']:.1f} s"
        ratio = f"  {f['restarted'] / baseline:5.1f}x the spare" if baseline else ""
        print(
            f"{label:40s} detected {f['detected']:5.1f} s  requeued {requeued:>7s}  "
            f"ranks restarted {f['restarted']:5.1f} s{ratio}"
        )


if __name__ == "__main__":
    main()
