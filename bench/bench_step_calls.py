"""What the library's per-step calls cost a healthy step, each alone and all together as
``steadfast demo``'s training loop (``examples/train.py``) makes them.

Two gloo ranks run the same loop of ``--steps`` steps of ``--step-ms`` each (a sleep: the
host waits for the GPU, as it does in a real step) plus a jitter of up to ``--jitter-ms``
that differs by rank and step, as real steps do. The model is the demo's (DDP over a
32-64-1 MLP, AdamW); each step runs its forward, backward and optimizer step. Each mode
adds its calls after each step:

- ``bare``: none (the baseline, measured in the same run);
- ``allreduce``: one bare all-reduce of one value on the default group, read at once:
  the floor of any check the ranks agree on before the step's update (at ``nan``'s
  place);
- ``blocking``: the agreed shutdown as it was, one all-reduce read at once
  (``count_true``): every step waits for the slowest rank's;
- ``agree``: ``ShutdownHandler(agree=True).should_shutdown(step)``, whose count runs in
  the background from one step to the next;
- ``nan``: ``NaNDetector.check_loss`` (its all-reduce decides this step's update: a
  DDP step's own all-reduce has the ranks in step already);
- ``straggler``: the demo's ``StragglerDetectionManager`` (its forward timed by
  ``wrap_train_step``, ``check(step)`` with a report every second);
- ``snapshot``: ``CheckpointManager(memory_every=1).snapshot``, the memory tier's copy
  of the model, the optimizer and the RNG streams every step;
- ``demo``: all of the library's calls of the demo's loop (``nan``, ``straggler``,
  ``agree``, ``snapshot``), ``agree``'s handler at its place: its flag rides on ``nan``'s
  all-reduce (``steadfast.riders``), so the loop makes one collective a step.

It prints, per mode, the time spent in the calls per step (mean over ranks and steps,
and the median step: the mean less the machine's scheduling outliers, which a 2-core
machine gives any collective) and the loop's time per step, and their share of the
step; then the demo's calls less the floor (``allreduce``): what the library adds to the
one collective its agreed NaN check must make; and the median of each of the demo's
calls apart.

    .venv/bin/python bench/bench_step_calls.py [--steps 60] [--step-ms 100] [--jitter-ms 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("bare", "allreduce", "blocking", "agree", "nan", "straggler", "snapshot", "demo")


def _rank(rank: int, world: int, store: str, args: Any, out: Any) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from steadfast import CheckpointManager, NaNDetector, ShutdownHandler
    from steadfast.dist import count_true
    from steadfast.straggler import NVRxStragglerDetectionConfig, StragglerDetectionManager

    cuda = args.device == "cuda"
    if cuda:  # a rank per GPU, as a job has
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rng = random.Random(rank)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    net = net.to(device)
    model = DDP(net, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    per_ms = 0.0
    if cuda:
        from sfgpu import spin_cycles

        per_ms = spin_cycles(100.0) / 100.0
    for mode in MODES:
        calls = {"demo": {"nan", "straggler", "agree", "snapshot"}}.get(mode, {mode})
        handler = ShutdownHandler(timeout_sec=0, agree=True)
        handler.should_shutdown(-1)  # its first call makes what it needs, once
        detector = NaNDetector(action="skip", max_consecutive=3)
        stragglers = StragglerDetectionManager(
            NVRxStragglerDetectionConfig(
                enabled="straggler" in calls, report_time_interval=1.0, enable_logging=False
            )
        )
        ckpt = CheckpointManager(Path(store).parent / f"ckpt-{mode}", memory_every=1)
        state = {"model": net, "optim": opt}

        def forward(batch: torch.Tensor) -> torch.Tensor:
            ms = args.step_ms + rng.uniform(0, args.jitter_ms)
            if cuda:  # the step's kernels: the stream is busy, the host is not
                torch.cuda._sleep(int(per_ms * ms))
            else:  # the host waits for the GPU, as it does in a real step
                time.sleep(ms / 1000)
            return model(batch)  # type: ignore[no-any-return]

        timed = stragglers.wrap_train_step(forward) if "straggler" in calls else forward
        dist.barrier()
        per_step: list[float] = []
        split: list[list[float]] = []
        start = time.perf_counter()
        for step in range(args.steps):
            loss = torch.nn.functional.mse_loss(timed(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t0 = time.perf_counter()
            ok = detector.check_loss(loss, step) if "nan" in calls else True
            if mode == "allreduce":  # where the NaN check's all-reduce is, read at once
                flag = torch.zeros(1, device=device)
                dist.all_reduce(flag)
                flag.item()
            in_call = time.perf_counter() - t0
            if ok:
                opt.step()
            t0 = time.perf_counter()
            if mode == "blocking":
                count_true(False)
            marks = [t0]
            if "straggler" in calls:
                stragglers.check(step)
                marks.append(time.perf_counter())
            if "agree" in calls:
                handler.should_shutdown(step)
                marks.append(time.perf_counter())
            if "snapshot" in calls:
                ckpt.snapshot(step + 1, state)
                marks.append(time.perf_counter())
            per_step.append(in_call + time.perf_counter() - t0)
            if mode == "demo":  # each call apart: nan, straggler, agree, snapshot
                split.append([in_call, *(b - a for a, b in itertools.pairwise(marks))])
        if cuda:
            torch.cuda.synchronize()  # the loop's time is the device's
        loop = time.perf_counter() - start
        handler.unregister()
        ckpt.close()
        out.put((mode, rank, sum(per_step) / args.steps, loop / args.steps, per_step, split))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--jitter-ms", type=float, default=10.0)
    ap.add_argument("--world", type=int, default=None, help="ranks (default: 2; CUDA: a GPU each)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo, a sleep for the step) or cuda "
                    "(NCCL, the step a kernel of --step-ms on the GPU)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.world is None:
        args.world = 2 if args.device == "cpu" else __import__("torch").cuda.device_count()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, args.world, store, args, out))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        rows = [out.get(timeout=600) for _ in range(len(MODES) * args.world)]
        for p in procs:
            p.join()
    step = args.step_ms / 1000
    what = "gloo ranks" if args.device == "cpu" else "NCCL ranks, a GPU each"
    print(
        f"{args.world} {what}, {args.steps} steps of {args.step_ms:g} ms "
        f"+ up to {args.jitter_ms:g} ms of jitter"
    )
    print(
        f"{'mode':<10} {'in call ms/step':>16} {'% of step':>10} {'median ms':>10}"
        f" {'loop ms/step':>13}"
    )
    bare = None
    for mode in MODES:
        mine = [r for r in rows if r[0] == mode]
        call = sum(r[2] for r in mine) / len(mine)
        loop = max(r[3] for r in mine)
        bare = loop if mode == "bare" else bare
        median = statistics.median(t for r in mine for t in r[4])
        print(
            f"{mode:<10} {call * 1000:>16.3f} {100 * call / step:>9.2f}% {median * 1000:>10.3f}"
            f" {loop * 1000:>13.2f}"
        )
    assert bare is not None
    per = {m: sum(r[2] for r in rows if r[0] == m) / args.world for m in MODES}
    beyond = per["demo"] - per["allreduce"]
    print(
        f"demo less the floor (one bare all-reduce): {beyond * 1000:.3f} ms/step, "
        f"{100 * beyond / step:.2f}% of the step"
    )
    split = [s for r in rows if r[0] == "demo" for s in r[5]]
    print(
        "the demo's calls apart, median ms (both ranks' steps): "
        + ", ".join(
            f"{name} {statistics.median(s[i] for s in split) * 1000:.3f}"
            for i, name in enumerate(("nan", "straggler", "agree", "snapshot"))
        )
    )
    loops = {m: max(r[3] for r in rows if r[0] == m) for m in MODES}
    for mode in MODES[1:]:
        print(f"loop time of {mode} / bare: {loops[mode] / bare:.4f}")
    if args.json:
        figures = {
            "device": args.device, "world": args.world, "steps": args.steps,
            "step_ms": args.step_ms, "jitter_ms": args.jitter_ms,
            "in_call_ms": {m: 1000 * per[m] for m in MODES},
            "loop_ms": {m: 1000 * loops[m] for m in MODES},
            "demo_over_bare": loops["demo"] / bare - 1.0,  # the healthy cost of its calls
            "demo_beyond_floor_ms": 1000 * beyond,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
