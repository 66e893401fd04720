"""How soon is a hang caught with nothing configured? (issue 30, monitor/learned.py)

Runs tests/e2e/learn_loop.py (2 ranks, 0.2 s a step, a heartbeat per step, rank 1 hangs
at step ``--hang-step``) under ``steadfast launch`` with no timeout given, twice:

- learned timeouts (steadfast's default): the time from the hang (``fault_injected``) to
  its detection (``rank_hung``);
- the baseline, ``--ft-learn-timeouts false``: the defaults every first run of NVRx's
  calculated timeouts has (they are computed from a run's observed intervals and applied
  from then on: on the first run, before any calculation, the configured defaults
  rule). NVRx 0.4.1's default is 45 minutes between heartbeats; NVRx's current source
  (``--nvrx PY``: the interpreter of scripts/nvrx-env.sh's venv) reads its own default,
  printed too. The baseline run is stopped after ``--cap`` seconds if the hang is not
  caught by then, and the figure is a lower bound.

    .venv/bin/python bench/bench_learned_timeouts.py [--nvrx .nvrx/venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOP = REPO / "tests" / "e2e" / "learn_loop.py"


def detect(hang_step: int, cap: float, *flags: str) -> float | None:
    """Seconds from the hang to its detection (None: not caught within ``cap``)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
            "--nproc-per-node=2", "--max-restarts=0", f"--run-dir={run}", *flags,
            str(LOOP), "--out", str(Path(tmp) / "out"), "--hang-step", str(hang_step),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("STEADFAST_EVENTS", None)
        proc = subprocess.Popen(
            cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        log = run / "events.jsonl"
        injected = None
        end = time.monotonic() + cap + 120
        while time.monotonic() < end and proc.poll() is None:
            evs = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            hit = [e for e in evs if e["kind"] == "fault_injected"]
            hung = [e for e in evs if e["kind"] == "rank_hung"]
            if hit and injected is None:
                injected = hit[0]["time"]
                end = time.monotonic() + cap
            if hung and injected is not None:
                proc.wait(60)
                return float(hung[0]["time"] - injected)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def nvrx_default(python: str) -> str:
    """NVRx's own default heartbeat timeout, read from its source."""
    code = (
        "from nvidia_resiliency_ext.fault_tolerance import FaultToleranceConfig as C; "
        "c = C(); print(c.rank_heartbeat_timeout, c.rank_out_of_section_timeout)"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return f"could not read it ({out.stderr.strip().splitlines()[-1:]})"
    hb, oos = out.stdout.split()
    return f"heartbeat timeout {hb}, out-of-section timeout {oos} (None: no hang detection)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hang-step", type=int, default=40)
    ap.add_argument("--cap", type=float, default=30.0)
    ap.add_argument("--nvrx", default=None, help="NVRx venv's python, to read its defaults")
    args = ap.parse_args()
    learned = detect(args.hang_step, args.cap)
    baseline = detect(args.hang_step, args.cap, "--ft-learn-timeouts", "false")
    print(f"hang at step {args.hang_step} of a 0.2 s/step job, nothing configured")
    print(f"  steadfast, learned timeouts:   caught {learned:.2f} s after the hang")
    if baseline is None:
        print(
            f"  NVRx's first run (0.4.1 defaults, 2700 s between heartbeats): not caught in "
            f"{args.cap:g} s (its timeout: 2700 s); ratio >= {args.cap / learned:.0f}x "
            f"(by its timeout: {2700 / learned:.0f}x)"
        )
    else:
        print(f"  baseline: caught {baseline:.2f} s; ratio {baseline / learned:.1f}x")
    if args.nvrx:
        print(f"  NVRx (current source) with nothing configured: {nvrx_default(args.nvrx)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
