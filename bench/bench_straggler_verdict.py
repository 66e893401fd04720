"""How soon a 2x slower rank is reported at the demo's pace, against the old design.

    .venv/bin/python bench/bench_straggler_verdict.py [--episodes 3] [--fault-free-steps 100]

Two gloo ranks run the demo's step in lockstep (``examples/train.py`` under ``steadfast
demo``): a timed forward (the demo's tiny model and a sleep of the demo's pace ``p``, the
compute it stands for), then an all-reduce (DDP's backward), then the report check. Rank
1 is slowed 2x (its forward sleeps ``2p``) for episodes of 12 steps, 10+ normal steps
apart. An episode's latency is from the start of its first slow step (where the demo
writes ``fault_injected``) to the end of the first report that flags rank 1 (relative or
individual score below 0.7, the demo's manager's thresholds). Measured in the same run:

- new: the demo's report interval now (``steadfast.demo.STRAGGLER_INTERVAL``) and the
  scoring window's floor (``WINDOW_SAMPLES`` samples spanning ``WINDOW_SECONDS``);
- old: the demo's interval before (``max(1 s, 8 p)``) and the samples since the last
  report only (``window_samples=1, window_seconds=0``).

Then a fault-free run of the new design (its false positives: any verdict) and the cost
of a report (``generate_time``: the all_gather and the scoring), and the floor's reason:
2 ranks at 6 ms steps (the uniform case of ``tests/dist/test_straggler.py``), a report
at every step, scored offline with windows of 1, 2, 3, 5 samples and the floor: how
many reports flag a healthy rank while ``--load`` busy processes share the machine (as
other jobs share this one: the noise that a short window must not report).
Target (issue 30): <= 2 s, no false positive.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

NOISE_STEP = 0.006
THRESHOLD = 0.7
#: A busy process of a shared machine: 20 ms of work, 10 ms of rest, until killed.
LOAD = """
import time
while True:
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:
        pass
    time.sleep(0.01)
"""


def demo_settings() -> tuple[float, float]:
    """The full demo's pace and straggler report interval, from the demo's own plan."""
    from steadfast import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    plan = demo._Plan(parser.parse_args([]))
    args = plan.script_args(1)
    return plan.pace, float(args[args.index("--straggler-interval") + 1])


def rank_main(rank: int, store_path: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's run of ``spec``; what the parent needs of it."""
    import torch
    import torch.distributed as dist

    from steadfast.straggler import Detector

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    if spec["kind"] == "noise":
        samples = noise_samples(spec["steps"])
        dist.destroy_process_group()
        return {"samples": samples}
    detector = Detector(report_time_interval=spec["interval"], **spec["window"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    data = torch.randn(16, 32)
    pace, slow_steps = spec["pace"], set(spec["slow"]) if rank == 1 else set()

    def forward(slow: bool) -> None:
        model(data)
        time.sleep(pace * (2 if slow else 1))

    timed = detector.wrap_callable(forward, "train_step")
    starts, reports = [], []
    x = torch.ones(1)
    for step in range(spec["steps"]):
        if step in slow_steps and step - 1 not in slow_steps:
            starts.append(time.monotonic())
        timed(step in slow_steps)
        dist.all_reduce(x)
        report = detector.generate_report_if_interval_elapsed()
        if report is not None:
            found = report.identify_stragglers(THRESHOLD, THRESHOLD, THRESHOLD, THRESHOLD)
            flagged = {s.rank for key in ("straggler_gpus_relative", "straggler_gpus_individual")
                       for s in found[key]}  # fmt: skip
            reports.append((time.monotonic(), step, sorted(flagged), report.generate_time))
    dist.destroy_process_group()
    return {"starts": starts, "reports": reports}


def noise_samples(steps: int) -> list[tuple[int, int]]:
    """``steps`` 6 ms sleeps in lockstep: (start, duration) in ns."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1)
    out = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        time.sleep(NOISE_STEP)
        out.append((start, time.perf_counter_ns() - start))
        dist.all_reduce(x)
    return out


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``spec`` on 2 gloo ranks (fresh processes); each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    os.path.join(tmp, "store"),
                    json.dumps(spec),
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, STEADFAST_EVENTS="off", OMP_NUM_THREADS="1"),
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def slowed(pace: float, interval: float, window: dict[str, Any], episodes: int) -> dict[str, Any]:
    """Latencies (s) of the verdicts on rank 1 and the false positives of one design."""
    slow, step = [], 12
    for e in range(episodes):
        slow += range(step, step + 12)
        step += 12 + 10 + e  # a different phase against the report schedule each time
    spec = {"kind": "run", "pace": pace, "interval": interval, "window": window,
            "slow": slow, "steps": step}  # fmt: skip
    zero, one = run(spec)
    starts, reports = one["starts"], zero["reports"]
    latencies, false = [], 0
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        hits = [t for t, _, flagged, _ in reports if start <= t < end and 1 in flagged]
        latencies.append(hits[0] - start if hits else float("nan"))
    slow_set = set(slow)
    for _, at, flagged, _ in reports:  # rank 1 is flagged rightly up to 8 steps after
        if 0 in flagged or (1 in flagged and not any(at - k in slow_set for k in range(9))):
            false += 1
    return {"latencies": latencies, "false": false, "reports": len(reports)}


def noise_flags(samples: list[list[tuple[int, int]]], least: int, seconds: float) -> int:
    """Reports (one per step) whose median over the window would flag a healthy rank."""
    from steadfast.straggler.detector import _window

    flags = 0
    for i in range(20, len(samples[0])):
        medians = []
        for rank_samples in samples:
            history = [(s, d, None) for s, d in rank_samples[: i + 1]]
            n = _window(history, 1, least, seconds)
            medians.append(statistics.median(d for _, d, _ in history[-n:]))
        flags += min(medians) / max(medians) < THRESHOLD
    return flags


def latency(pace: float, interval: float, episodes: int) -> None:
    """The new design's and the old one's latencies, and their ratio."""
    from steadfast.straggler.detector import WINDOW_SAMPLES, WINDOW_SECONDS

    old_interval = max(1.0, 8 * pace)
    print(f"demo's pace {pace:.3f} s/step, rank 1 slowed 2x in {episodes} episodes of 12 "
          f"steps; 2 gloo ranks")  # fmt: skip
    new = slowed(pace, interval, {}, episodes)
    old = slowed(pace, old_interval, {"window_samples": 1, "window_seconds": 0.0}, episodes)
    for name, got, what in (
        ("new", new, f"a report every {interval} s, window floor {WINDOW_SAMPLES} samples "
                     f"/ {WINDOW_SECONDS} s"),
        ("old", old, f"a report every {old_interval:.2f} s, samples since the last report"),
    ):  # fmt: skip
        lat = ", ".join(f"{v:.2f}" for v in got["latencies"])
        print(f"  {name}: slowdown -> verdict {lat} s (max {max(got['latencies']):.2f} s); "
              f"false positives {got['false']} in {got['reports']} reports; {what}")  # fmt: skip
    new_mean, old_mean = statistics.mean(new["latencies"]), statistics.mean(old["latencies"])
    print(f"  mean latency: new {new_mean:.2f} s, old {old_mean:.2f} s: "
          f"{old_mean / new_mean:.1f}x sooner (target <= 2 s)")  # fmt: skip


def fault_free(pace: float, interval: float, steps: int) -> None:
    """The new design's false positives on healthy ranks, and what a report costs."""
    spec = {"kind": "run", "pace": pace, "interval": interval, "window": {}, "slow": [],
            "steps": steps}  # fmt: skip
    reports = run(spec)[0]["reports"]
    false = sum(1 for *_, flagged, _ in reports if flagged)
    cost = statistics.median(r[3] for r in reports)
    period = (reports[-1][0] - reports[0][0]) / max(1, len(reports) - 1)
    print(f"fault-free, {steps} steps at the demo's pace: false positives {false} in "
          f"{len(reports)} reports")  # fmt: skip
    print(f"a report (all_gather + scores, 2 ranks): {cost * 1e3:.2f} ms median, one per "
          f"{period:.2f} s: {100 * cost / period:.2f} % of the time")  # fmt: skip


def floor(steps: int, load: int) -> None:
    """Healthy 6 ms steps beside ``load`` busy processes, scored with several windows."""
    from steadfast.straggler.detector import WINDOW_SAMPLES, WINDOW_SECONDS

    hogs = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(load)]
    try:
        samples = [r["samples"] for r in run({"kind": "noise", "steps": steps})]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"the floor: {steps} steps of {NOISE_STEP * 1e3:.0f} ms on 2 healthy ranks beside "
          f"{load} busy processes, a report at every step; reports that flag one (relative "
          f"score < {THRESHOLD}):")  # fmt: skip
    for least, seconds in ((1, 0.0), (2, 0.0), (3, 0.0), (5, 0.0), (10, 0.0),
                           (WINDOW_SAMPLES, WINDOW_SECONDS)):  # fmt: skip
        flags = noise_flags(samples, least, seconds)
        label = f"{least} samples" + (f" / {seconds} s (the floor)" if seconds else "")
        print(f"  window {label:<30} {flags:>5} of {len(samples[0]) - 20}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        print(json.dumps(rank_main(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=3, help="slow episodes per design")
    ap.add_argument("--fault-free-steps", type=int, default=100)
    ap.add_argument("--noise-steps", type=int, default=2000, help="6 ms steps for the floor")
    ap.add_argument("--load", type=int, default=3, help="busy processes beside them")
    ns = ap.parse_args()
    pace, interval = demo_settings()
    if ns.episodes > 0:
        latency(pace, interval, ns.episodes)
    if ns.fault_free_steps > 0:
        fault_free(pace, interval, ns.fault_free_steps)
    if ns.noise_steps > 20:
        floor(ns.noise_steps, ns.load)


if __name__ == "__main__":
    main()
