"""The quick tier: the tests that cover the most of steadfast's code per second.

    python scripts/quick_tier.py measure [PYTEST ARGS]  # cover each test, time each test
    python scripts/quick_tier.py pick [--budget S]      # choose: writes tests/quick.txt
    python scripts/quick_tier.py run [PYTEST ARGS]      # run them (``make quick``)

``measure`` runs pytest with coverage.py started in every Python process of the run: the
pytest process, each process it starts (coverage's own ``.pth`` file starts it where
``COVERAGE_PROCESS_START`` is set) and each process those fork (``patch = fork``; a
process ending by ``os._exit`` saves too). Each line covered is recorded under the
test's id: ``tests/conftest.py`` names the context at each test's setup and passes it to
the processes the test starts (``STEADFAST_COV_CONTEXT``); each test's seconds (setup,
call, teardown) go to ``build/quick/times.json``.

``pick`` is greedy: it takes the test with the most lines not yet covered per second of
its own, again and again, while the sum of seconds stays within the budget. The seconds
are those measured under coverage (slower than without: the budget is kept with room).
A session fixture's start (the Slurm cluster, the rank template) is paid by the first
test that uses it, so the tier's wall time is checked by running it.

CI runs every test; the tier is for a developer between edits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "quick"
TIER = ROOT / "tests" / "quick.txt"
CONFIG = """\
[run]
source = steadfast
parallel = true
data_file = {data}
context = ${{STEADFAST_COV_CONTEXT}}
patch = fork, _exit
"""


def measure(pytest_args: list[str]) -> int:
    """Run pytest under coverage, every process of it; combine the data."""
    import coverage

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    config = OUT / "coverage.ini"
    config.write_text(CONFIG.format(data=OUT / "cov"))
    env = dict(
        os.environ,
        COVERAGE_PROCESS_START=str(config),
        STEADFAST_COV_CONTEXT="",
        STEADFAST_TEST_TIMES=str(OUT / "times.json"),
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
    code = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    cov = coverage.Coverage(data_file=str(OUT / "cov"), config_file=str(config))
    cov.combine([str(OUT)])
    cov.save()
    print(f"measured (pytest exit {code}): {OUT / 'cov'}, {OUT / 'times.json'}")
    return 0 if (OUT / "times.json").exists() else 1


def covered_by_test() -> dict[str, set[tuple[str, int]]]:
    """Each test's covered lines, as (file, line)."""
    from coverage import CoverageData

    data = CoverageData(basename=str(OUT / "cov"))
    data.read()
    lines: dict[str, set[tuple[str, int]]] = {}
    for path in data.measured_files():
        rel = os.path.relpath(path, ROOT)
        for lineno, contexts in data.contexts_by_lineno(path).items():
            for label in contexts:
                test = label.split("|")[-1]  # a forked rank: "template's|its own"
                if test:
                    lines.setdefault(test, set()).add((rel, lineno))
    return lines


def pick(budget: float) -> int:
    times: dict[str, float] = json.loads((OUT / "times.json").read_text())
    lines = covered_by_test()
    every = set().union(*lines.values()) if lines else set()
    chosen: list[str] = []
    seen: set[tuple[str, int]] = set()
    spent = 0.0
    left = {t for t in lines if t in times}
    while left:
        gain = {t: len(lines[t] - seen) / max(times[t], 0.05) for t in left}
        fits = [t for t in left if spent + times[t] <= budget and gain[t] > 0]
        if not fits:
            break
        best = max(fits, key=lambda t: (gain[t], t))
        chosen.append(best)
        seen |= lines[best]
        spent += times[best]
        left.discard(best)
    share = len(seen) / max(len(every), 1)
    head = [
        f"# The quick tier (scripts/quick_tier.py pick --budget {budget:g}, "
        f"{datetime.date.today().isoformat()}): {len(chosen)} of {len(times)} tests measured,",
        f"# {spent:.0f} s under coverage, covering {len(seen)} of the {len(every)} lines of "
        f"src/steadfast the measured tests cover ({share:.0%}). In the order picked.",
    ]
    TIER.write_text("\n".join([*head, *chosen]) + "\n")
    print("\n".join(head))
    return 0


def tier() -> list[str]:
    return [ln for ln in TIER.read_text().splitlines() if ln and not ln.startswith("#")]


def run(pytest_args: list[str]) -> int:
    """The tier's tests, file by file (a module's fixtures made once), in pytest."""
    ordered = sorted(tier(), key=lambda test: test.split("::")[0])  # stable within a file
    cmd = [sys.executable, "-m", "pytest", *pytest_args, *ordered]
    return subprocess.run(cmd, cwd=ROOT).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("measure", help="run pytest under coverage (extra args go to pytest)")
    chooser = sub.add_parser("pick", help="choose the tier from the last measurement")
    chooser.add_argument("--budget", type=float, default=200.0, help="seconds (default 200)")
    sub.add_parser("run", help="run the tier (extra args go to pytest)")
    args, rest = p.parse_known_args()
    if args.what == "measure":
        return measure(rest)
    if args.what == "pick":
        return pick(args.budget)
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
