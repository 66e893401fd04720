"""A training script for the launcher tests: 2-rank gloo DDP with sections, heartbeats,
checkpoints, and one injected fault (``steadfast.faults.fail_at``, once per run).

    steadfast launch --nproc-per-node 2 ... ft_train.py --ckpt DIR --out FILE \
        [--fault KIND --fault-rank R --fault-step K --where WHERE]

``KIND`` is a :class:`~steadfast.faults.FaultKind`; ``--where`` says where it strikes:
``step`` (inside the step section of step K, the default), ``checkpointing`` (inside
the save of step K), ``out_of_section`` (after the step section of step K), ``setup``
(before the first step) or ``start`` (before monitoring starts: no heartbeat ever).
``--every-generation`` makes it strike in every worker generation, not once per run.
Under ``--rerun``, ``--fault nan_burst`` is a NaN loss on the first attempt of step K
(transient), and ``--nan-on HW`` a NaN on every attempt while the hardware id is HW (a
faulty GPU: persistent; HW as faked by ``$STEADFAST_RERUN_HARDWARE_ID``), or
``--nan-on-host HOST`` on every attempt of whichever rank runs on the machine HOST (a
real move: the tests with several nodes).

The data of a step depends only on (step, rank), so a run that is restarted from its
latest checkpoint ends bit-identical to one that never failed.

``--data N`` trains one epoch of an N-sample dataset instead: a ResumableSampler over
the world, the global data position (DataPosition) in the replicated state, and a
sharded DTensor (``seen``: how often each sample was trained on, sharded over the ranks)
saved through DCP. Restarted with another number of ranks (an elastic job that lost a
node), the position is shared out among the new ranks and ``seen`` resharded, so the
output's ``seen`` is all ones exactly when every sample was trained on once.

``--cuda`` trains on the rank's GPU (``LOCAL_RANK``) over NCCL, the manager's own
collectives on gloo; the data is drawn on the CPU as without it.

``--memory-every N`` snapshots every N steps to the memory tier
(``CheckpointManager(memory_every=N)``) besides the disk checkpoint every
``--ckpt-every`` steps; ``--kill-every K`` SIGKILLs ``--fault-rank`` in the step section
of every K-th step, once each (a series of crashes for the in-job restarts).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import CheckpointManager, ShutdownHandler, events, setup_simulated_fault
from steadfast.checkpoint import ShardedTrainState
from steadfast.faults import FaultKind, fail_at
from steadfast.monitor import RankMonitorClient, load_ft_state, save_ft_state
from steadfast.rerun import (
    HARDWARE_ID_ENV,
    RerunDataIterator,
    RerunStateMachine,
    RerunStateMachineConfig,
)

WHERE = ("step", "checkpointing", "out_of_section", "setup", "start")


class _NoMonitor:
    def __getattr__(self, name: str):
        return lambda *a, **k: None


def _corrupt_own_snapshots(rank: int) -> None:
    """Flip one byte in the middle of every file of this rank's every memory snapshot
    (sizes kept): its ``rank.pt``, and its ``state.pt`` where it keeps one (the node's
    first rank keeps the replicated state for the node)."""
    from steadfast.checkpoint.memory import MEMORY_DIR_ENV

    for state in Path(os.environ[MEMORY_DIR_ENV]).glob(f"*/own/rank_{rank}/step_*/*.pt"):
        with open(state, "r+b") as fh:
            fh.seek(state.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fault", choices=[k.value for k in FaultKind], default=None)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=5)
    ap.add_argument("--where", choices=WHERE, default="step")
    ap.add_argument("--every-generation", action="store_true")
    ap.add_argument("--nan-on", default=None, help="with --rerun: NaN at --fault-step on HW")
    ap.add_argument("--nan-on-host", default=None, help="with --rerun: the same on host HOST")
    ap.add_argument("--calc-timeouts", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--no-ft", action="store_true", help="run without the rank monitor")
    ap.add_argument("--simulate", default=None, help="a Megatron Bridge simulated_fault_type")
    ap.add_argument("--graceful", action="store_true", help="save and stop on SIGTERM")
    ap.add_argument("--rerun", action="store_true", help="steps under the re-run state machine")
    ap.add_argument("--step-log", type=Path, default=None, help="append 'rank step time' per step")
    ap.add_argument("--data", type=int, default=0, help="one epoch of N samples (see above)")
    ap.add_argument("--batch", type=int, default=1, help="with --data: samples per rank and step")
    ap.add_argument("--memory-every", type=int, default=0, help="memory tier snapshots")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--cuda", action="store_true", help="on the rank's GPU, over NCCL")
    ap.add_argument("--ckpt-every", type=int, default=2, help="disk checkpoints")
    ap.add_argument("--kill-every", type=int, default=0, help="SIGKILL every K-th step")
    ap.add_argument(
        "--corrupt-memory",
        action="store_true",
        help="flip a byte of each own snapshot before the kill",
    )
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    once = None if args.every_generation else args.ckpt.parent / "faults"
    fault = (
        fail_at(args.fault_rank, args.fault_step, args.fault, once_dir=once) if args.fault else None
    )

    def strike(where: str, step: int) -> bool:
        """The fault, if it strikes here (True while a NaN burst lasts)."""
        return fault is not None and args.where == where and fault.check(step, rank)

    strike("start", args.fault_step)  # stuck before monitoring starts (e.g. in an import)
    ft = RankMonitorClient()
    ft_state = args.ckpt / "ft_state.json"
    if args.no_ft:  # plain torchrun: the client's calls are never reached for real
        ft = _NoMonitor()  # type: ignore[assignment]
    else:
        ft.init_workload_monitoring()
        load_ft_state(ft, ft_state)
    ft.start_section("setup")
    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.cuda else "gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    net = net.to(device)
    if args.fsdp:  # every rank keeps its shards; the reduction layout is fixed
        from torch.distributed.fsdp import fully_shard

        fully_shard(net[0])
        model = fully_shard(net)
    else:  # buckets never rebuilt: a resumed run reduces as the one that never stopped
        model = DDP(net, find_unused_parameters=True, device_ids=[device] if args.cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = CheckpointManager(args.ckpt, keep_last_n=2, memory_every=args.memory_every)
    machine = None
    if args.rerun:
        machine = RerunStateMachine(
            RerunStateMachineConfig(
                rerun_mode="validate_results",
                result_rejected_tracker_filename=str(args.ckpt / "rerun_tracker.jsonl"),
            )
        )
    objects: dict = (
        {"train": ShardedTrainState(net, opt)}
        if args.fsdp
        else {"model": model.module, "optim": opt}
    )
    if args.data:
        return _epoch(args, rank, model, opt, ckpt, ft, strike)
    rank_state = {"rerun": machine} if machine is not None else None
    restored = ckpt.restore({**objects, **(rank_state or {})})
    start = restored[0] if restored else 0
    resumed = str(ckpt.loaded_path) if restored and ckpt.loaded_path else None
    events.job_start(start, dist.get_world_size(), resumed)
    strike("setup", args.fault_step)
    ft.end_section("setup")
    stop = ShutdownHandler(timeout_sec=30, agree=True) if args.graceful else None
    if stop is not None:
        stop.register()
    if args.simulate and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        setup_simulated_fault(
            simulate_fault=True,
            simulated_fault_type=args.simulate,
            simulated_fault_rank=args.fault_rank,
            simulated_fault_base_delay=0.5,
            extra_delay_max=0.3,
        )
    for step in range(start, args.steps):
        began = time.monotonic()
        ft.send_heartbeat()
        ft.start_section("step")
        if args.fault != FaultKind.NAN_BURST.value:  # a NaN strikes in the forward
            strike("step", step)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        x, y = x.to(device), y.to(device)
        if machine is None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
        else:  # the seed's loop: the step may run again with the same batch
            data = RerunDataIterator([(x, y)])
            while machine.should_run_forward_backward(data):
                bx, by = next(data)
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(bx), by)
                faulty_gpu = step == args.fault_step and (
                    (
                        args.nan_on is not None
                        and os.environ.get(HARDWARE_ID_ENV) == args.nan_on
                        and rank == args.fault_rank
                    )
                    or args.nan_on_host == socket.gethostname()  # whichever rank runs there
                )
                if faulty_gpu or strike("step", step):
                    loss = loss * float("nan")
                loss.backward()
                machine.validate_loss(loss)
            save_now, exit_now, code = machine.should_checkpoint_and_exit()
            if save_now or exit_now:  # the step's update is not applied
                ft.end_section("step")
            if save_now:  # resume at this step
                ft.start_section("checkpointing")
                ckpt.save(step, objects, rank_state=rank_state)
                ft.end_section("checkpointing")
            if exit_now:
                ckpt.close()
                ft.shutdown_workload_monitoring()
                dist.destroy_process_group()
                return code
        opt.step()
        time.sleep(args.step_sleep)
        # late in the step: the snapshot of the steps before is written by now
        if args.kill_every and step and step % args.kill_every == 0 and rank == args.fault_rank:
            killer = fail_at(rank, step, "rank_killed", once_dir=args.ckpt.parent / "k")
            if args.corrupt_memory and not (killer.once_dir / killer.marker).exists():
                _corrupt_own_snapshots(rank)  # then die: the restart must not trust them
            killer.check(step, rank)
        ft.end_section("step")
        events.emit("step_done", step=step, seconds=round(time.monotonic() - began, 6))
        if args.step_log is not None:  # for bench_node_loss.py: when each step ended
            with args.step_log.open("a") as log:
                log.write(f"{rank} {step} {time.time()}\n")
        strike("out_of_section", step)
        if stop is not None and stop.should_shutdown(step):  # every rank, the same step
            ft.start_section("checkpointing")
            ckpt.save_emergency(step + 1, objects, rank_state=rank_state)
            ft.end_section("checkpointing")
            stop.finish()
            break
        if args.memory_every:
            ckpt.snapshot(step + 1, objects, rank_state=rank_state)
        if (step + 1) % args.ckpt_every == 0:
            ft.start_section("checkpointing")
            strike("checkpointing", step + 1)
            ckpt.save(step + 1, objects, rank_state=rank_state)
            ft.end_section("checkpointing")
    if args.calc_timeouts:  # the step's timeout from the steps seen (as examples/train.py)
        ft.calculate_and_set_section_timeouts(["step"], calc_out_of_section=False)
        if rank == 0:
            save_ft_state(ft, ft_state)
    ckpt.close()
    final = {  # FSDP2: the full parameters, gathered on every rank (collective)
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()).cpu()
        for k, v in net.state_dict().items()
    }
    if rank == 0:
        torch.save(final, args.out)
    ft.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


def _epoch(args, rank, model, opt, ckpt, ft, strike) -> int:
    """``--data N``: one epoch with a global data position and a sharded ``seen``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.utils.data import DataLoader, TensorDataset

    from steadfast import DataPosition, ResumableSampler

    world, n = dist.get_world_size(), args.data
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    sampler = ResumableSampler(n, num_replicas=world, rank=rank, seed=3)
    loader = DataLoader(
        TensorDataset(torch.arange(n), xs, ys), batch_size=args.batch, sampler=sampler
    )
    data = DataPosition(loader)
    mesh = init_device_mesh("cpu", (world,))
    seen = distribute_tensor(torch.zeros(n), mesh, [Shard(0)])
    objects = {"model": model.module, "optim": opt, "data": data, "seen": seen}
    restored = ckpt.restore(objects)
    step = restored[0] if restored else 0
    strike("setup", args.fault_step)
    ft.end_section("setup")
    for idx, x, y in data:
        ft.send_heartbeat()
        ft.start_section("step")
        strike("step", step)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        trained = torch.zeros(n)
        trained[idx] += 1
        dist.all_reduce(trained)
        mine = DTensor.from_local(trained, mesh, [Replicate()]).redistribute(mesh, [Shard(0)])
        seen.to_local().add_(mine.to_local())
        time.sleep(args.step_sleep)
        ft.end_section("step")
        step += 1
        if step % 2 == 0:
            ft.start_section("checkpointing")
            strike("checkpointing", step)
            ckpt.save(step, objects)
            ft.end_section("checkpointing")
    full = seen.full_tensor()
    ckpt.close()
    if rank == 0:
        out = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save({**out, "seen": full, "steps": torch.tensor(step)}, args.out)
    ft.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
