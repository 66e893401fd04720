"""Re-run state machine cost per step when nothing goes wrong, in one process.

    .venv/bin/python bench/bench_rerun.py

The same training step (a 2-layer MLP, forward + backward + SGD, two micro-batches)
with the seed's loop around it, in ``disabled`` and ``validate_results`` mode (which
saves the RNG state at each step and validates each micro-batch's loss), against the bare
step; interleaved rounds, fastest of each. The collective the machine adds per step under
torch.distributed is one 1-element all-reduce (not measured here: it is the same as
``agree_any``'s).
"""

from __future__ import annotations

import time

import torch

from steadfast.rerun import RerunDataIterator, RerunStateMachine, RerunStateMachineConfig

STEPS, ROUNDS, MICRO = 300, 7, 2


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    batches = [(torch.randn(64, 256), torch.randn(64, 1)) for _ in range(8)]

    def micro(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(net(x), y) / MICRO
        loss.backward()
        return loss

    def bare() -> float:
        t0 = time.perf_counter()
        for i in range(STEPS):
            opt.zero_grad()
            for j in range(MICRO):
                micro(*batches[(i + j) % 8])
            opt.step()
        return time.perf_counter() - t0

    def with_machine(mode: str) -> float:
        machine = RerunStateMachine(RerunStateMachineConfig(rerun_mode=mode))
        data = RerunDataIterator(batches[i % 8] for i in range(10**9))
        t0 = time.perf_counter()
        for _ in range(STEPS):
            while machine.should_run_forward_backward(data):
                opt.zero_grad()
                for _ in range(MICRO):
                    machine.validate_loss(micro(*next(data)))
            machine.should_checkpoint_and_exit()
            opt.step()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"bare": [], "disabled": [], "validate_results": []}
    for _ in range(ROUNDS):
        times["bare"].append(bare())
        times["disabled"].append(with_machine("disabled"))
        times["validate_results"].append(with_machine("validate_results"))
    base = min(times["bare"]) / STEPS
    print(f"bare step: {base * 1e3:.3f} ms (baseline, same run)")
    for mode in ("disabled", "validate_results"):
        per = min(times[mode]) / STEPS
        print(
            f"{mode:>16}: {per * 1e3:.3f} ms/step, +{(per - base) * 1e6:.1f} us "
            f"({100 * (per / base - 1):+.2f}%)"
        )


if __name__ == "__main__":
    main()
