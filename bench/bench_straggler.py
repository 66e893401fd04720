"""Straggler detector cost: overhead on a 3 ms step, and report time for 2 ranks.

    .venv/bin/python bench/bench_straggler.py

- overhead: the same 3 ms (busy) step loop with and without the detector (profiling
  every step, a report every 5 s), interleaved rounds in one run, fastest of each;
- report time: 2 gloo ranks, median of 20 ``generate_report`` calls (one all_gather).
Target (issue 6): overhead < 1%.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def overhead() -> float:
    from steadfast.straggler import Detector

    det = Detector(report_time_interval=5.0, profiling_interval=1)
    step = det.wrap_callable(lambda: busy(0.003), "train_step")
    plain, timed = [], []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(300):
            busy(0.003)
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(300):
            step()
            det.generate_report_if_interval_elapsed()
        timed.append(time.perf_counter() - t0)
    return (min(timed) - min(plain)) / min(plain)


def rank_main(rank: int, world: int, store_path: str) -> None:
    import torch.distributed as dist

    from steadfast.straggler import Detector

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    det = Detector(report_time_interval=5.0)
    for _ in range(50):
        with det.detection_section("train_step"):
            busy(0.001)
    times = []
    for _ in range(20):
        with det.detection_section("train_step"):
            busy(0.001)
        times.append(det.generate_report().generate_time)
    if rank == 0:
        print(f"{statistics.median(times) * 1e3:.3f}")
    dist.destroy_process_group()


def report_time() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(r), store],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, STEADFAST_EVENTS="off"),
            )
            for r in range(2)
        ]
        outs = [p.communicate(120)[0] for p in procs]
    return float(outs[0].strip())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), 2, sys.argv[3])
        return
    ov = overhead()
    ms = report_time()
    print(
        f"detector on a 3 ms step (profiling every step): overhead {100 * ov:+.3f}% vs the "
        f"same loop without it (target < 1%)"
    )
    print(f"report time, 2 gloo ranks: {ms:.3f} ms (median of 20)")


if __name__ == "__main__":
    main()
