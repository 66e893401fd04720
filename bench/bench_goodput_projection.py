"""Goodput at a user's scale, projected from each fault's cost and a published fault rate.

A model, not a measurement: every input is printed with the result. The equation:

    goodput(N) = 1 - h - s/T - sum_k  rate_k * N * cost_k(N)

- ``N`` GPUs; ``rate_k`` the interruptions of kind ``k`` per GPU-hour, from Meta's Llama 3
  405B run (16,384 H100s, 54 days, 419 unexpected interruptions; the causes' counts of its
  Table 5, each mapped to the fault kind that recovers it, ``CAUSES`` below). The rate per
  GPU is taken as constant: a job of N GPUs meets N times one GPU's faults.
- ``h``: what healthy steps lose to the library (its calls' share of a step, as
  bench/bench_step_calls.py measures it); ``s/T``: a blocking checkpoint save of ``s``
  seconds every ``T``.
- ``cost_k(N) = detect_k + restart_k(N) + redo_k``, in hours of the whole job:
  - ``detect_k``: from the fault to its detection;
  - ``restart_k(N) = restart_here_k + doubling_s * log2(N / gpus_here)``: from the
    detection to the first step, as measured on this machine, plus one rendezvous /
    communicator bootstrap round more per doubling of the world (an assumption, the same
    for every system), plus ``requeue_s`` where the job must go back to the scheduler;
  - ``redo_k``: the steps done again. From an in-memory snapshot taken every
    ``snapshot_every`` steps: half an interval on average plus the restore's proof steps;
    from the last disk checkpoint: half the disk cadence, plus its load.

The systems: steadfast (spares, in-memory snapshots, learned timeouts), torchrun (its
elastic agent restarts the workers of a crash; a lost node or a hang ends the job: NCCL's
watchdog, 10 minutes by default, then a requeue from the last disk checkpoint), NVRx
(in-job restart; hangs found by its calculated section timeouts, 5 x the longest step;
restarts from the user's last disk checkpoint). The per-fault costs measured here are
arguments with their source: ``MEASURED`` below, or ``--costs``, the JSON
bench/bench_fault_costs.py writes (its ``systems``, MEASURED's shape, and the proof's
steps a restore re-does, its ``proof_steps``).

    .venv/bin/python bench/bench_goodput_projection.py [--step-s 5] [--ckpt-interval-s 1800]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

#: Llama 3 405B (Meta, "The Llama 3 Herd of Models", 2024, Table 5): the 419 unexpected
#: interruptions of a 54-day snapshot on 16,384 GPUs, by cause, and the fault kind that
#: recovers each here: a node taken out of the job (hardware, host maintenance), a crash
#: of the training process on healthy hardware (a software bug), a hang (NCCL watchdog
#: timeouts), a wrong result found by a failed proof (silent data corruption). (The
#: paper's own percentages do not all match its counts: 148 of 419 is 35.3 %, printed
#: 30.1 %; the counts are used.)
CAUSES: dict[str, tuple[int, str]] = {
    "Faulty GPU": (148, "lost_node"),
    "GPU HBM3 memory": (72, "lost_node"),
    "Software bug": (54, "crash"),
    "Network switch/cable": (35, "lost_node"),
    "Host maintenance": (32, "lost_node"),
    "GPU SRAM memory": (19, "lost_node"),
    "GPU system processor": (17, "lost_node"),
    "NIC": (7, "lost_node"),
    "NCCL watchdog timeouts": (7, "hang"),
    "Silent data corruption": (6, "proof_failed"),
    "GPU thermal interface + sensor": (6, "lost_node"),
    "SSD": (3, "lost_node"),
    "Power supply": (3, "lost_node"),
    "Server chassis": (2, "lost_node"),
    "IO expansion board": (2, "lost_node"),
    "Dependency": (2, "crash"),
    "CPU": (2, "lost_node"),
    "System memory": (2, "lost_node"),
}
LLAMA3_GPUS, LLAMA3_HOURS = 16_384, 54 * 24.0

#: Seconds from the fault to its detection and from the detection to the first step, as
#: measured on this machine (2 cores, 2 ranks a node), with where each figure comes from.
#: ``None``: the system does not recover that kind in the job (see ``_cost``).
MEASURED: dict[str, dict[str, dict[str, float | str | None]]] = {
    "steadfast": {
        "crash": {"detect": 0.0, "restart": 0.85, "source": "the demo: kill -> first step"},
        "hang": {"detect": None, "restart": 0.61, "source": "the demo: 2.46 s, 1.85 detection"},
        "lost_node": {"detect": 0.0, "restart": 0.84, "source": "the bed: spare, own rdzv"},
        "proof_failed": {"detect": 0.0, "restart": 0.85, "source": "as a crash"},
    },
    "torchrun": {
        "crash": {"detect": 0.0, "restart": 0.85, "source": "as steadfast's (same agent)"},
        "hang": {"detect": 600.0, "restart": None, "source": "NCCL watchdog default"},
        "lost_node": {"detect": 0.0, "restart": None, "source": "job ends: requeue"},
        "proof_failed": {"detect": None, "restart": None, "source": "not detected"},
    },
    "nvrx": {
        "crash": {"detect": 0.0, "restart": 0.85, "source": "assumed as steadfast's"},
        "hang": {"detect": None, "restart": 0.61, "source": "section timeout 5x step"},
        "lost_node": {"detect": 0.0, "restart": 14.8, "source": "the bed: spare, c10d keep-alive"},
        "proof_failed": {"detect": None, "restart": None, "source": "not detected"},
    },
}


@dataclass(frozen=True)
class Inputs:
    step_s: float  # one training step at the user's scale
    ckpt_interval_s: float  # disk checkpoint cadence
    ckpt_save_s: float  # the blocking part of one disk save
    ckpt_load_s: float  # loading the last disk checkpoint at scale
    snapshot_every: int  # steadfast's in-memory snapshot cadence, in steps
    snapshot_load_s: float  # restoring it (from this node's or a peer's memory)
    proof_steps: float  # steps a restore's proof re-does beyond the lost ones
    requeue_s: float  # back to the scheduler: queue, allocation, cold start at scale
    doubling_s: float  # restart seconds more per doubling of the world
    healthy: dict[str, float]  # the library's share of a healthy step, per system
    sdc_found_after_s: float  # a silent corruption is found this long after it happened
    gpus_here: int = 4


def rates_per_gpu_hour() -> dict[str, float]:
    """Interruptions per GPU-hour by fault kind, from the Llama 3 counts."""
    out: dict[str, float] = {}
    for count, kind in CAUSES.values():
        out[kind] = out.get(kind, 0.0) + count / (LLAMA3_GPUS * LLAMA3_HOURS)
    return out


def _cost(system: str, kind: str, n: int, inp: Inputs, costs: dict) -> float:
    """Seconds of the whole job one fault of ``kind`` costs ``system`` at ``n`` GPUs."""
    c = costs[system][kind]
    scale = inp.doubling_s * max(0.0, math.log2(n / inp.gpus_here))
    disk_redo = inp.ckpt_interval_s / 2 + inp.ckpt_load_s
    if system == "steadfast":
        detect = c["detect"]
        if detect is None:  # a hang: the learned timeout, 3 x the longest step, 5 s floor
            detect = max(3.0 * inp.step_s, 5.0)
        redo = (inp.snapshot_every / 2 + inp.proof_steps) * inp.step_s + inp.snapshot_load_s
        if kind == "proof_failed":  # back to the last proven state before the corruption
            redo = inp.sdc_found_after_s + inp.ckpt_load_s
        return float(detect) + float(c["restart"]) + scale + redo
    if system == "nvrx" and kind == "hang":
        return 5.0 * inp.step_s + float(c["restart"]) + scale + disk_redo
    if c["detect"] is None:  # not detected: runs on, wrong; counted as the lost work
        return inp.sdc_found_after_s + disk_redo + inp.requeue_s
    if c["restart"] is None:  # the job ends and goes back to the scheduler
        return float(c["detect"]) + inp.requeue_s + scale + disk_redo
    return float(c["detect"]) + float(c["restart"]) + scale + disk_redo


def goodput(system: str, n: int, inp: Inputs, costs: dict) -> tuple[float, dict[str, float]]:
    """The projected goodput and each fault kind's share of the loss."""
    lost = {
        kind: rate * n * _cost(system, kind, n, inp, costs) / 3600.0
        for kind, rate in rates_per_gpu_hour().items()
    }
    save = inp.ckpt_save_s / inp.ckpt_interval_s
    return 1.0 - inp.healthy[system] - save - sum(lost.values()), lost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="1024,16384,100000")
    ap.add_argument("--step-s", type=float, default=5.0)
    ap.add_argument("--ckpt-interval-s", type=float, default=1800.0)
    ap.add_argument("--ckpt-save-s", type=float, default=10.0)
    ap.add_argument("--ckpt-load-s", type=float, default=60.0)
    ap.add_argument("--snapshot-every", type=int, default=1)
    ap.add_argument("--snapshot-load-s", type=float, default=5.0)
    ap.add_argument("--proof-steps", type=float, default=None, help="default: --costs's, else 1.25")
    ap.add_argument("--requeue-s", type=float, default=600.0)
    ap.add_argument("--doubling-s", type=float, default=0.5)
    ap.add_argument("--sdc-found-after-s", type=float, default=3600.0)
    ap.add_argument("--healthy-steadfast", type=float, default=0.005)
    ap.add_argument("--costs", type=Path, default=None, help="bench_fault_costs.py's JSON (--out)")
    args = ap.parse_args()
    data = json.loads(args.costs.read_text()) if args.costs else {"systems": MEASURED}
    costs = data["systems"]
    if args.proof_steps is None:
        args.proof_steps = data.get("proof_steps") or 1.25
    inp = Inputs(
        step_s=args.step_s, ckpt_interval_s=args.ckpt_interval_s, ckpt_save_s=args.ckpt_save_s,
        ckpt_load_s=args.ckpt_load_s, snapshot_every=args.snapshot_every,
        snapshot_load_s=args.snapshot_load_s, proof_steps=args.proof_steps,
        requeue_s=args.requeue_s, doubling_s=args.doubling_s,
        healthy={"steadfast": args.healthy_steadfast, "torchrun": 0.0, "nvrx": 0.0},
        sdc_found_after_s=args.sdc_found_after_s,
    )  # fmt: skip
    rates = rates_per_gpu_hour()
    print("goodput(N) = 1 - h - s/T - sum_k rate_k * N * cost_k(N)")
    print("inputs:", json.dumps(inp.__dict__))
    print("rates per GPU-hour (Llama 3 405B, 419 interruptions / 16,384 GPUs / 54 days):")
    for kind, rate in rates.items():
        print(f"  {kind:<13} {rate:.3e}  (one every {1 / (rate * LLAMA3_GPUS):.1f} h at 16,384)")
    print("per-fault costs measured here (s):")
    for system, kinds in costs.items():
        for kind, c in kinds.items():
            print(f"  {system:<10} {kind:<13} detect={c['detect']} restart={c['restart']}"
                  f"  ({c['source']})")  # fmt: skip
    print()
    print(f"{'GPUs':>8} {'system':<10} {'goodput':>8}   loss by kind (points)")
    for n in (int(g) for g in args.gpus.split(",")):
        for system in costs:
            g, lost = goodput(system, n, inp, costs)
            parts = ", ".join(f"{k} {100 * v:.2f}" for k, v in lost.items())
            print(f"{n:>8} {system:<10} {100 * g:>7.2f}%   {parts}")
    n = 100_000
    total_rate = sum(rates.values()) * n
    budget = 0.03 - inp.healthy["steadfast"] - inp.ckpt_save_s / inp.ckpt_interval_s
    print()
    print(
        f"97 % at {n:,} GPUs: {total_rate:.2f} interruptions an hour leave "
        f"{3600 * budget / total_rate:.0f} s per fault on average, detection, restart and "
        f"re-done steps together (after h={inp.healthy['steadfast']:.3f} and "
        f"s/T={inp.ckpt_save_s / inp.ckpt_interval_s:.4f})"
    )


if __name__ == "__main__":
    main()
