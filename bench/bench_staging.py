"""Host staging for an async save: steadfast's ``Stager`` against torch's own
``DefaultStager`` (``torch.distributed.checkpoint.staging``), and both against one plain
copy of the same bytes into buffers already allocated (the floor: a ``memcpy``).

    .venv/bin/python bench/bench_staging.py [--mb 1024] [--repeats 7]

The state is ``--mb`` MB of float32 tensors (16 of them, as a model's layers); every
stager stages it ``--repeats`` times after one warm-up (a training job stages the same
shapes every save, so the steady state is what matters), interleaved round by round so
each sees the same memory conditions. Medians are printed with their ratio to the
memcpy floor. ``DefaultStager`` runs with the options that work without CUDA (no pinned
memory, no async staging); with ``use_shared_memory`` on and off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from steadfast.checkpoint.staging import Stager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    n = args.mb * 1024 * 1024 // 4 // 16
    state = {f"layer{i}": torch.randn(n) for i in range(16)}
    floor = {k: torch.empty_like(v) for k, v in state.items()}

    def memcpy() -> Any:
        for k, v in state.items():
            floor[k].copy_(v)
        return floor

    ours = Stager()
    torch_plain = DefaultStager(StagingOptions(False, False, False, False))
    torch_shm = DefaultStager(StagingOptions(False, True, False, False))
    contenders: dict[str, Callable[[], Any]] = {
        "memcpy into warm buffers (floor)": memcpy,
        "steadfast Stager": lambda: ours.stage(state),
        "torch DefaultStager": lambda: torch_plain.stage(state),
        "torch DefaultStager, shared memory": lambda: torch_shm.stage(state),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(args.repeats + 1):
        for name, stage in contenders.items():
            t0 = time.perf_counter()
            staged = stage()
            elapsed = time.perf_counter() - t0
            if round_:  # the first round allocates: not the steady state
                times[name].append(elapsed)
            first = next(iter(staged.values()))
            assert torch.equal(first, state["layer0"]), name
        for v in state.values():  # training moves on between saves
            v.add_(1.0)
    base = statistics.median(times["memcpy into warm buffers (floor)"])
    print(f"staging {args.mb} MB ({len(state)} tensors), median of {args.repeats}:")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:38s} {median * 1e3:8.1f} ms  {median / base:5.2f}x memcpy")
    ours_t = statistics.median(times["steadfast Stager"])
    best_torch = min(
        statistics.median(times["torch DefaultStager"]),
        statistics.median(times["torch DefaultStager, shared memory"]),
    )
    print(f"torch's best / steadfast Stager: {best_torch / ours_t:.2f}x")
    torch_plain.close()
    torch_shm.close()


if __name__ == "__main__":
    main()
