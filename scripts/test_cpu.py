"""Where the suite's CPU goes: read what ``STEADFAST_TEST_CPU=DIR pytest ...`` wrote
(tests/conftest.py) and print the tests and folders that cost the most CPU seconds.

    STEADFAST_TEST_CPU=/tmp/cpu make pytest
    python scripts/test_cpu.py /tmp/cpu [--top 30]

then, where the record says when each test started, when each worker ended: the
last is the suite's wall; the CPU-bound workers should end together.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    tests: dict[str, tuple[float, float]] = {}
    workers: dict[str, list[list[float]]] = {}  # each worker's tests: [cpu, wall, start]
    for f in sorted(args.folder.glob("cpu-*.json")):
        record = json.loads(f.read_text())
        tests.update({k: (v[0], v[1]) for k, v in record.items()})
        workers[f.stem.removeprefix("cpu-")] = list(record.values())
    if not tests:
        p.error(f"{args.folder}: no cpu-*.json (was STEADFAST_TEST_CPU set for the run?)")
    cpu = sum(c for c, _ in tests.values())
    wall = sum(w for _, w in tests.values())
    print(f"{len(tests)} tests: {cpu / 60:.1f} CPU-min in {wall / 60:.1f} worker-min")
    print(f"\n{'CPU s':>8} {'wall s':>8}  test (top {args.top} by CPU)")
    for name, (c, w) in sorted(tests.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{c:8.1f} {w:8.1f}  {name}")
    folders: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for name, (c, w) in tests.items():
        folder = "/".join(name.split("::")[0].split("/")[:2])
        folders[folder][0] += c
        folders[folder][1] += w
        folders[folder][2] += 1
    print(f"\n{'CPU min':>8} {'wall min':>8} {'tests':>6}  folder")
    for folder, (c, w, n) in sorted(folders.items(), key=lambda kv: -kv[1][0]):
        print(f"{c / 60:8.1f} {w / 60:8.1f} {int(n):6d}  {folder}")
    starts = [v[2] for runs in workers.values() for v in runs if len(v) > 2]
    if starts:  # a record that says when each test started: when each worker ended
        print(f"\n{'ends min':>8} {'CPU min':>8} {'tests':>6}  worker (ends: from the first start)")
        for name, runs in sorted(workers.items()):
            end = max(v[2] + v[1] for v in runs) - min(starts)
            print(f"{end / 60:8.1f} {sum(v[0] for v in runs) / 60:8.1f} {len(runs):6d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
