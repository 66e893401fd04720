"""Megatron Bridge / Megatron-LM names (seed 003) called as their users call them, on
steadfast: the process's re-run state machine (get_rerun_state_machine and Megatron-LM's
constructor) and the NVRx straggler manager with its helpers, on real 2-rank groups."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import run_ranks
from steadfast.rerun import (
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunStateMachine,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)
from steadfast.straggler import (
    NVRxStragglerDetectionConfig,
    NVRxStragglerDetectionManager,
    check_nvrx_straggler_detection,
    safe_shutdown_nvrx_straggler_manager,
)


def seeds_train_step(rank: int, world: int, workdir: Path) -> Any:
    """The seed's train_step under Megatron-LM's singleton, with a custom state saved
    and restored around the re-run, and a NaN on rank 1 at step 1 (first attempt only)."""
    counter = {"value": 0}
    restored: list[Any] = []
    initialize_rerun_state_machine(
        state_save_func=lambda: dict(counter),
        state_restore_func=lambda saved: (restored.append(saved), counter.update(saved)),
        mode=RerunMode.VALIDATE_RESULTS,
        error_injector=RerunErrorInjector(error_injection_rate=0),
    )
    iterations, verdicts = [], []
    for step in range(3):
        machine = get_rerun_state_machine()
        data = RerunDataIterator(iter([torch.tensor(float(step))]))
        attempt = 0
        while machine.should_run_forward_backward(data):
            counter["value"] += 1  # state the step changes; the re-run must restore it
            loss = next(data) + 1.0
            if rank == 1 and step == 1 and attempt == 0:
                loss = loss * float("nan")
            machine.validate_loss(loss)
            attempt += 1
        iterations.append(machine.current_iteration)
        verdicts = list(machine.verdicts)
        should_checkpoint, should_exit, code = machine.should_checkpoint_and_exit()
        if should_exit:  # a NaN loss is fatal (transient or not): exit 17, no checkpoint
            assert (should_checkpoint, code) == (False, 17)
            break
    destroy_rerun_state_machine()
    return iterations, verdicts, restored, counter["value"]


def test_the_seeds_train_step_with_get_rerun_state_machine(tmp_path: Path) -> None:
    for iterations, verdicts, restored, count in run_ranks(seeds_train_step, tmp_path, 2):
        assert iterations == [1, 2] and verdicts == ["transient"]
        assert restored == [{"value": 1}]  # saved before step 1, restored for its re-run
        assert count == 2  # the re-run's change replaced the first attempt's


def test_megatron_lms_constructor_and_modes() -> None:
    def save() -> dict[str, int]:
        return {}

    def restore(saved: Any) -> None:
        return None

    machine = RerunStateMachine(save, restore, RerunMode.REPORT_DETERMINISM_STATS)
    assert machine.get_mode() is RerunMode.REPORT_DETERMINISM_STATS
    assert machine.config.rerun_mode == "report_stats"  # Megatron Bridge's name for it
    machine.set_mode("validate_results")
    assert machine.mode == "validate_results" and machine.state_restore_func is restore
    injected = RerunStateMachine(
        mode="validate_results",
        error_injector=RerunErrorInjector(7, RerunDiagnostic.PERSISTENT_ERROR),
    )
    assert (injected.config.error_injection_rate, injected.config.error_injection_type) == (
        7, "persistent_error")  # fmt: skip
    state = machine.state_dict(data_iterator=None, ckpt_format="torch_dist", force=True)
    RerunStateMachine().load_state_dict(state)


def straggling(rank: int, world: int, workdir: Path) -> Any:
    manager = NVRxStragglerDetectionManager(
        NVRxStragglerDetectionConfig(enabled=True, report_time_interval=0.05, stop_if_detected=True)
    )
    manager.initialize()
    step = manager.wrap_train_step_function(lambda: time.sleep(0.003 * (1 + 2 * rank)))
    stop_at = None
    for i in range(60):
        step()
        torch.distributed.all_reduce(torch.ones(1))  # lockstep
        if check_nvrx_straggler_detection(manager):
            stop_at = i
            break
    safe_shutdown_nvrx_straggler_manager(manager)
    return stop_at, manager.initialized


def test_the_nvrx_straggler_manager_stops_every_rank_together(tmp_path: Path) -> None:
    (zero, off0), (one, off1) = run_ranks(straggling, tmp_path, 2)
    assert zero is not None and zero == one and not (off0 or off1)


def test_straggler_helpers_without_a_manager(caplog: pytest.LogCaptureFixture) -> None:
    assert check_nvrx_straggler_detection(None) is False
    safe_shutdown_nvrx_straggler_manager(None)

    class Broken(NVRxStragglerDetectionManager):
        def shutdown(self) -> None:
            raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="nvrx_straggler"):
        safe_shutdown_nvrx_straggler_manager(Broken(NVRxStragglerDetectionConfig()))
    assert "boom" in caplog.text
