"""In-process restart: a data-parallel loop that survives a fault without a new process.

    steadfast launch --nproc-per-node 2 examples/inprocess_train.py --steps 20 \\
        --fault exception:1:8

The training function is wrapped in ``steadfast.inprocess.Wrapper``. It initialises
torch.distributed itself, from ``RANK``/``WORLD_SIZE`` (which the Wrapper sets for every
iteration) and ``call_wrapper.store`` (a fresh store prefix per iteration). The model and
optimizer state live in memory outside the function: a snapshot after every step is what
the next iteration resumes from, so a restart loses at most the step that failed. Each
rank also keeps the snapshot before, and every iteration starts from the older step any
rank holds: the interruption can land between a rank's last collective of a step and its
snapshot, after its peers took theirs, and ranks that resumed from different steps would
run them against each other (a restart without end).

``--fault KIND:RANK:STEP`` (``steadfast.faults.fail_at``, once: the process lives on
across iterations): ``exception`` raises, ``rank_killed`` sends SIGKILL (the other ranks
go on with a smaller world, ranks shifted), ``rank_hung`` stops calling ``ping()`` while
the interpreter keeps running (the soft timeout interrupts).
``--out FILE`` writes the final parameters (``torch.save``) from rank 0.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from steadfast.faults import parse_fault
from steadfast.inprocess import CallWrapper, RetryController, Wrapper


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True).tanh()
    return x[rank::world], y[rank::world]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--fault", default=None, help="KIND:RANK:STEP (exception|rank_killed|rank_hung)"
    )
    parser.add_argument("--soft-timeout", type=float, default=5.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    fault = parse_fault(args.fault) if args.fault else None
    initial_rank = int(os.environ["RANK"])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    memory: dict[str, Any] = {"step": 0, "model": model.state_dict(), "opt": opt.state_dict()}
    before: dict[str, Any] = {}  # the snapshot before the newest

    def snapshot(step: int) -> None:
        before.update(memory)
        memory["step"] = step
        memory["model"] = {k: v.clone() for k, v in model.state_dict().items()}
        memory["opt"] = {
            "state": {
                k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
                for k, v in opt.state_dict()["state"].items()
            },
            "param_groups": opt.state_dict()["param_groups"],
        }

    snapshot(0)

    @Wrapper(
        soft_timeout=timedelta(seconds=args.soft_timeout),
        hard_timeout=timedelta(seconds=args.soft_timeout * 2),
        barrier_timeout=timedelta(seconds=args.soft_timeout * 4),
        monitor_thread_interval=timedelta(seconds=0.5),
        monitor_process_interval=timedelta(seconds=0.5),
        progress_watchdog_interval=timedelta(seconds=0.5),
        initialize=RetryController(max_iterations=5),
    )
    def train(call_wrapper: CallWrapper | None = None) -> dict[str, torch.Tensor]:
        assert call_wrapper is not None
        cw = call_wrapper
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", store=cw.store, rank=rank, world_size=world)
        oldest = torch.tensor([memory["step"]])
        dist.all_reduce(oldest, op=dist.ReduceOp.MIN)  # the step every rank holds
        if int(oldest.item()) != memory["step"]:  # one step ahead: take the one before
            memory.update(before)
        model.load_state_dict(memory["model"])
        opt.load_state_dict(memory["opt"])
        print(
            f"[{initial_rank}] iteration {cw.iteration}: rank {rank} of {world}, "
            f"from step {memory['step']}",
            flush=True,
        )
        for step in range(memory["step"], args.steps):
            cw.ping()
            if fault is not None:
                fault.check(step, initial_rank)
            x, y = _batch(step, rank, world)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            with cw.atomic():  # never half a snapshot: the interruption waits for it
                snapshot(step + 1)
        dist.destroy_process_group()
        return {k: v.clone() for k, v in model.state_dict().items()}

    params = train()
    if args.out and initial_rank == 0 and params is not None:
        torch.save(params, args.out)
    print(f"[{initial_rank}] done", flush=True)


if __name__ == "__main__":
    main()
