"""A training script for the launcher tests: 2-rank gloo DDP with sections, heartbeats,
checkpoints, and one injected fault in the first worker generation.

    steadfast launch --nproc-per-node 2 ... ft_train.py --ckpt DIR --out FILE \
        [--fault KIND --fault-rank R --fault-step K]

The data of a step depends only on (step, rank), so a run that is restarted from its
latest checkpoint ends bit-identical to one that never failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import CheckpointManager, ShutdownHandler, setup_simulated_fault
from steadfast.monitor import RankMonitorClient, load_ft_state, save_ft_state
from steadfast.rerun import (
    HARDWARE_ID_ENV,
    RerunDataIterator,
    RerunStateMachine,
    RerunStateMachineConfig,
)

FAULTS = (
    "none",
    "hang_step",
    "hang_checkpointing",
    "hang_out_of_section",
    "no_heartbeat",
    "kill",
    "raise",
    "exit3",
    "always_fail",
    "nan_transient",  # a NaN loss on the first attempt only (with --rerun)
    "nan_persistent",  # a NaN loss whenever the hardware id is "node-a" (with --rerun)
)


class _NoMonitor:
    def __getattr__(self, name: str):
        return lambda *a, **k: None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=5)
    ap.add_argument("--calc-timeouts", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--no-ft", action="store_true", help="run without the rank monitor")
    ap.add_argument("--simulate", default=None, help="a Megatron Bridge simulated_fault_type")
    ap.add_argument("--graceful", action="store_true", help="save and stop on SIGTERM")
    ap.add_argument("--rerun", action="store_true", help="steps under the re-run state machine")
    args = ap.parse_args()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    faulty = (generation == 0 or args.fault == "always_fail") and rank == args.fault_rank
    fault = args.fault if faulty else "none"

    if fault == "no_heartbeat":
        time.sleep(3600)  # stuck before monitoring even starts (e.g. in an import)
    ft = RankMonitorClient()
    ft_state = args.ckpt / "ft_state.json"
    if args.no_ft:  # plain torchrun: the client's calls are never reached for real
        ft = _NoMonitor()  # type: ignore[assignment]
    else:
        ft.init_workload_monitoring()
        load_ft_state(ft, ft_state)
    ft.start_section("setup")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = CheckpointManager(args.ckpt, keep_last_n=2)
    machine = None
    if args.rerun:
        machine = RerunStateMachine(
            RerunStateMachineConfig(
                rerun_mode="validate_results",
                result_rejected_tracker_filename=str(args.ckpt / "rerun_tracker.jsonl"),
            )
        )
    objects = {"model": model.module, "optim": opt}
    rank_state = {"rerun": machine} if machine is not None else None
    restored = ckpt.restore({**objects, **(rank_state or {})})
    start = restored[0] if restored else 0
    if fault == "always_fail":
        raise RuntimeError("injected: fails before any step, every generation")
    ft.end_section("setup")
    stop = ShutdownHandler(timeout_sec=30, agree=True) if args.graceful else None
    if stop is not None:
        stop.register()
    if args.simulate and generation == 0:
        setup_simulated_fault(
            simulate_fault=True,
            simulated_fault_type=args.simulate,
            simulated_fault_rank=args.fault_rank,
            simulated_fault_base_delay=0.5,
            extra_delay_max=0.3,
        )
    for step in range(start, args.steps):
        ft.send_heartbeat()
        ft.start_section("step")
        if fault == "hang_step" and step == args.fault_step:
            time.sleep(3600)
        if fault == "kill" and step == args.fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "raise" and step == args.fault_step:
            raise RuntimeError(f"injected failure at step {step}")
        if fault == "exit3" and step == args.fault_step:
            os._exit(3)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if machine is None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
        else:  # the seed's loop: the step may run again with the same batch
            data = RerunDataIterator([(x, y)])
            attempt = 0
            while machine.should_run_forward_backward(data):
                bx, by = next(data)
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(bx), by)
                bad = rank == args.fault_rank and step == args.fault_step
                if bad and (
                    (fault == "nan_transient" and attempt == 0)
                    or (
                        args.fault == "nan_persistent"
                        and os.environ.get(HARDWARE_ID_ENV) == "node-a"
                    )
                ):
                    loss = loss * float("nan")
                loss.backward()
                machine.validate_loss(loss)
                attempt += 1
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
        ft.end_section("step")
        if fault == "hang_out_of_section" and step == args.fault_step:
            time.sleep(3600)
        if stop is not None and stop.should_shutdown(step):  # every rank, the same step
            ft.start_section("checkpointing")
            ckpt.save_emergency(step + 1, objects, rank_state=rank_state)
            ft.end_section("checkpointing")
            stop.finish()
            break
        if (step + 1) % 2 == 0:
            ft.start_section("checkpointing")
            if fault == "hang_checkpointing" and step + 1 == args.fault_step:
                time.sleep(3600)
            ckpt.save(step + 1, objects, rank_state=rank_state)
            ft.end_section("checkpointing")
    if args.calc_timeouts:
        ft.calculate_and_set_section_timeouts()
        ft.calculate_and_set_hb_timeouts()
        if rank == 0:
            save_ft_state(ft, ft_state)
    ckpt.close()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, args.out)
    ft.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
