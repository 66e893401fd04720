"""steadfast's GPU checks, one after the other, as one table and one JSON file (``make
gpu-check``, after ``scripts/gpu-check.sh`` found a GPU and a Python whose torch uses it).

Each check is a program of the working tree run with this Python, a time limit of its
own inside :data:`BUDGET` (8 minutes on one GPU), its figures read back from the JSON it
writes:

============== ===========================================================================
``tests``      ``tests/gpu`` (NCCL agreement, CUDA state, the CUDA launch, the NVML check)
``nvml``       the NVML check's tests alone (the restart's wait for freed GPU memory)
``restart``    the CUDA template's restart, phase by phase (goal: process_start <= 0.3 s)
``staging``    the memory tier's GPU staging: the host's stall against a memcpy, whether
               it synchronised the device (goal: no), the snapshot read back right
``conformance`` the conformance probe with each rank on CUDA: a worker is torchrun's
``step_cost``  the library's calls on a 100 ms CUDA step (goal: <= 0.5 %)
============== ===========================================================================

    python scripts/gpu_check.py [--out gpu-check.json] [--only NAME,...] [--device cpu]

``--device cpu`` runs what has a CPU form (restart, staging, step_cost, tests) on the
CPU: the table and the JSON of this machine, to try the command without a GPU; its
figures are no GPU's. The revision measured is ``$GPU_CHECK_REV``, else ``git describe``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: seconds for all the checks together
BUDGET = 480.0
PROCESS_START_GOAL = 0.3  # seconds
STEP_COST_GOAL = 0.005  # of a 100 ms step


@dataclass
class Row:
    """One check's line of the table."""

    name: str
    ok: bool | None  # None: not run (skipped, or out of time)
    result: str
    goal: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    log: str = ""  # a failed check's output, its end


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``argv`` from the repository's root; (exit code, its output's tail)."""
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(timeout, 1.0),
                              env={**os.environ, **(env or {})})  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return 124, f"timed out after {timeout:.0f} s\n{out[-2000:]}"
    return done.returncode, (done.stdout + done.stderr)[-4000:]


def _pytest(paths: list[str], xml: Path, timeout: float, env: dict[str, str] | None = None,
            select: str | None = None) -> tuple[int, str, dict[str, int]]:  # fmt: skip
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            f"--junitxml={xml}", *paths, *(["-k", select] if select else [])]  # fmt: skip
    code, out = _run(argv, timeout, env)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    return code, out, counts


def _tests_line(counts: dict[str, int]) -> str:
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    return f"{passed} passed, {failed} failed, {counts['skipped']} skipped"


def check_tests(tmp: Path, left: float, device: str) -> Row:
    code, out, counts = _pytest(["tests/gpu"], tmp / "gpu.xml", left)
    ok = code == 0 and counts["tests"] > 0 and (device == "cpu" or counts["skipped"] == 0)
    return Row("tests", ok, _tests_line(counts), "all pass, none skipped", figures=counts,
               log="" if ok else out)  # fmt: skip


def check_nvml(tmp: Path, left: float, device: str) -> Row:
    code, out, counts = _pytest(["tests/gpu/test_gpu_memory_check.py"], tmp / "nvml.xml", left)
    ok = code == 0 and counts["tests"] > 0 and counts["skipped"] == 0
    return Row("nvml", ok if device != "cpu" else None, _tests_line(counts), "all pass",
               figures=counts, log="" if ok else out)  # fmt: skip


def check_restart(tmp: Path, left: float, device: str) -> Row:
    out_json = tmp / "restart.json"
    argv = [sys.executable, "bench/bench_restart_phases.py", "--plain-only", "--json",
            str(out_json), *(["--cuda"] if device == "cuda" else [])]  # fmt: skip
    code, out = _run(argv, left)
    if code != 0 or not out_json.exists():
        return Row("restart", False, f"failed (exit {code})", log=out)
    got = json.loads(out_json.read_text())
    phases = got["uncompiled_restart"]
    start = float(phases.get("process_start", float("nan")))
    total = sum(float(v) for v in phases.values())
    return Row("restart", start <= PROCESS_START_GOAL,
               f"process_start {start:.3f} s of a {total:.2f} s restart",
               f"process_start <= {PROCESS_START_GOAL} s", figures=got)  # fmt: skip


def check_staging(tmp: Path, left: float, device: str) -> Row:
    out_json = tmp / "staging.json"
    small = ["--mb", "64", "--repeats", "3"] if device == "cpu" else []
    argv = [sys.executable, "bench/bench_gpu_staging.py", "--device", device, "--json",
            str(out_json), *small]  # fmt: skip
    code, out = _run(argv, left)
    if code != 0 or not out_json.exists():
        return Row("staging", False, f"failed (exit {code})", log=out)
    got = json.loads(out_json.read_text())
    synced = got["synchronised"]
    result = (f"stall {got['stall_s'] * 1e3:.1f} ms, {got['stall_over_memcpy']:.2f}x the memcpy; "
              f"landed {got['landed_s'] * 1e3:.1f} ms; "
              + ("synchronised" if synced else "no sync" if synced is False else "sync n/a")
              + ("" if got["right"] else "; READ BACK WRONG"))  # fmt: skip
    return Row("staging", bool(got["right"]) and not synced, result,
               "no sync; read back right", figures=got)  # fmt: skip


def check_conformance(tmp: Path, left: float, device: str) -> Row:
    env = {"STEADFAST_PROBE_CUDA": "1"} if device == "cuda" else {}
    code, out, counts = _pytest(["tests/e2e/test_conformance.py"], tmp / "conf.xml", left, env)
    ok = code == 0 and counts["tests"] > 0 and counts["skipped"] == 0
    return Row("conformance", ok, _tests_line(counts), "a worker is torchrun's",
               figures=counts, log="" if ok else out)  # fmt: skip


def check_step_cost(tmp: Path, left: float, device: str) -> Row:
    out_json = tmp / "steps.json"
    argv = [sys.executable, "bench/bench_step_calls.py", "--device", device, "--steps", "30",
            "--step-ms", "100", "--jitter-ms", "0", "--json", str(out_json)]  # fmt: skip
    code, out = _run(argv, left)
    if code != 0 or not out_json.exists():
        return Row("step_cost", False, f"failed (exit {code})", log=out)
    got = json.loads(out_json.read_text())
    cost = float(got["demo_over_bare"])
    return Row("step_cost", cost <= STEP_COST_GOAL,
               f"the demo's calls: {100 * cost:+.2f} % of a 100 ms step",
               f"<= {100 * STEP_COST_GOAL:.1f} %", figures=got)  # fmt: skip


CHECKS: dict[str, Callable[[Path, float, str], Row]] = {
    "tests": check_tests, "nvml": check_nvml, "restart": check_restart,
    "staging": check_staging, "conformance": check_conformance, "step_cost": check_step_cost,
}  # fmt: skip


def revision() -> str:
    if os.environ.get("GPU_CHECK_REV"):
        return os.environ["GPU_CHECK_REV"]
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    except Exception as exc:  # a broken CUDA build: said, not raised
        return f"unknown ({type(exc).__name__})"


def table(rows: list[Row]) -> str:
    marks = {True: "ok", False: "FAIL", None: "-"}
    lines = [f"{'check':<12} {'':<4} {'seconds':>7}  {'result':<58} goal"]
    for r in rows:
        lines.append(f"{r.name:<12} {marks[r.ok]:<4} {r.seconds:7.1f}  {r.result:<58} {r.goal}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check.json", help="the JSON written")
    ap.add_argument("--only", default=",".join(CHECKS), help="checks to run, comma-separated")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"--only: no check {', '.join(unknown)}; the checks: {', '.join(CHECKS)}")
    import torch

    began = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp_name:
        for name in names:
            left = BUDGET - (time.monotonic() - began)
            if left < 20:
                rows.append(Row(name, None, f"not run: the {BUDGET:.0f} s budget was spent"))
                continue
            t0 = time.monotonic()
            row = CHECKS[name](Path(tmp_name), left, args.device)
            row.seconds = time.monotonic() - t0
            rows.append(row)
            print(table([row]).splitlines()[1], flush=True)
    report = {
        "revision": revision(),
        "device": args.device,
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - began, 1),
        "checks": [asdict(r) for r in rows],
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nsteadfast gpu-check at {report['revision']}: {report['gpu']}, torch "
          f"{report['torch']}, {report['seconds']:.0f} s")  # fmt: skip
    print(table(rows))
    for r in rows:
        if r.log and r.ok is False:
            print(f"\n--- {r.name}: the end of its output\n{r.log[-1500:]}")
    print(f"written: {args.out}")
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
