"""The re-run state machine in one process: attribution of transient, persistent and
correct results (with a faked hardware move), replayed batches, spiky loss, stats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from steadfast import ConfigError
from steadfast.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    HARDWARE_ID_ENV,
    RerunDataIterator,
    RerunStateMachine,
    RerunStateMachineConfig,
    relative_difference,
)


def test_relative_difference():
    assert relative_difference(1.0, 1.0) == 0.0
    assert relative_difference(float("nan"), float("nan")) == 0.0
    assert relative_difference(1.0, float("nan")) == math.inf
    assert relative_difference(1.0, 3.0) == pytest.approx(1.0)


def _step(machine, data, seen):
    """One training step under the seed's contract; the loss is the batch's mean plus
    a random draw (so RNG restoration matters)."""
    runs = 0
    while machine.should_run_forward_backward(data):
        batch = next(data)
        seen.append(batch.tolist())
        loss = batch.float().mean() + torch.rand(()) * 0  # deterministic given the RNG
        noise = torch.rand(())
        machine.validate_result(loss + noise, torch.isnan, "loss is NaN")
        runs += 1
    return runs, machine.should_checkpoint_and_exit()


def _machine(kind: str, tmp_path: Path) -> RerunStateMachine:
    cfg = RerunStateMachineConfig(
        rerun_mode="validate_results",
        error_injection_rate=1,
        error_injection_type=kind,
        result_rejected_tracker_filename=str(tmp_path / "tracker"),
    )
    return RerunStateMachine(cfg, seed=0)


def test_transient_error_is_not_reproduced_in_place(tmp_path: Path, event_log: Path):
    machine = _machine("transient_error", tmp_path)
    data = RerunDataIterator(torch.arange(12).reshape(6, 2))
    seen: list = []
    runs, decision = _step(machine, data, seen)
    assert runs == 2 and seen[0] == seen[1]  # the re-run replayed the same batch
    assert machine.verdicts == ["transient"]
    assert decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)  # fatal=True
    records = [json.loads(x) for x in (tmp_path / "tracker").read_text().splitlines()]
    assert [r["status"] for r in records] == ["rejected", "transient"]
    assert {"time", "node", "device", "job_id", "rank", "iteration", "result",
            "message"} <= set(records[0])  # fmt: skip
    verdicts = [json.loads(x) for x in event_log.read_text().splitlines()]
    assert [e["kind"] for e in verdicts] == ["rerun_result_rejected", "rerun_verdict"]


@pytest.mark.parametrize(("kind", "verdict", "exit_after"), [
    ("persistent_error", "persistent", (False, False, 0)),
    ("correct_result", "correct", (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)),
])  # fmt: skip
def test_reproduced_in_place_exits_16_then_the_second_rerun_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, verdict: str, exit_after
):
    monkeypatch.setenv(HARDWARE_ID_ENV, "node-a/gpu0")
    machine = _machine(kind, tmp_path)
    data = RerunDataIterator(torch.arange(12).reshape(6, 2))
    seen: list = []
    runs, decision = _step(machine, data, seen)
    assert runs == 2 and decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    # through a file, as the checkpoint manager stores it (weights_only on load)
    torch.save(machine.state_dict(), tmp_path / "rerun.pt")
    state = torch.load(tmp_path / "rerun.pt", weights_only=True)
    # the job restarts on other hardware from the checkpoint saved with exit 16
    monkeypatch.setenv(HARDWARE_ID_ENV, "node-b/gpu3")
    restarted = _machine(kind, tmp_path)
    fresh = RerunDataIterator(torch.arange(12).reshape(6, 2)[1:])  # the stream moved on
    restarted.load_state_dict(state, fresh)
    seen_after: list = []
    runs, decision = _step(restarted, fresh, seen_after)
    assert runs == 1 and seen_after == [seen[0]]  # the same micro-batch, replayed
    assert restarted.verdicts == [verdict] and decision == exit_after


def test_same_hardware_after_restart_asks_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(HARDWARE_ID_ENV, "node-a/gpu0")
    machine = _machine("persistent_error", tmp_path)
    data = RerunDataIterator(torch.arange(12).reshape(6, 2))
    _step(machine, data, [])
    again = _machine("persistent_error", tmp_path)
    again.load_state_dict(machine.state_dict(), data)
    runs, decision = _step(again, data, [])
    assert runs == 0 and decision == (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)


def test_nan_loss_goes_through_the_machine_and_normal_steps_run_once(tmp_path: Path):
    machine = RerunStateMachine(RerunStateMachineConfig(rerun_mode="validate_results"))
    data = RerunDataIterator(range(10))
    runs = 0
    while machine.should_run_forward_backward(data):
        next(data)
        machine.validate_result(torch.tensor(1.0), torch.isnan, "loss is NaN")
        runs += 1
    assert runs == 1 and machine.should_checkpoint_and_exit() == (False, False, 0)
    runs = 0
    while machine.should_run_forward_backward(data):
        next(data)
        machine.validate_result(torch.tensor(float("nan")), torch.isnan, "loss is NaN", fatal=False)
        runs += 1
    assert runs == 2  # rejected, re-run in place: NaN again -> reproduced
    assert machine.should_checkpoint_and_exit() == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)


def test_validate_loss_checks_what_the_config_asks(tmp_path: Path):
    cfg = RerunStateMachineConfig(rerun_mode="validate_results", check_for_spiky_loss=True)
    machine = RerunStateMachine(cfg)
    data = RerunDataIterator(range(1000))

    def step(loss: float) -> tuple[int, tuple[bool, bool, int]]:
        runs = 0
        while machine.should_run_forward_backward(data):
            next(data)
            machine.validate_loss(torch.tensor(loss))
            runs += 1
        return runs, machine.should_checkpoint_and_exit()

    for i in range(100):  # the first 100 losses set the scale; none is rejected
        assert step(2.0 - 0.01 * i) == (1, (False, False, 0))
    assert step(5 * 2.0) == (1, (False, False, 0))  # 5x the largest: not a spike
    assert step(20 * 2.0) == (2, (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE))  # reproduced
    for bad in (float("nan"), float("inf")):
        again = RerunStateMachine(RerunStateMachineConfig(rerun_mode="validate_results"))
        runs = 0
        while again.should_run_forward_backward(data):
            next(data)
            again.validate_loss(torch.tensor(bad))
            runs += 1
        assert runs == 2 and again.should_checkpoint_and_exit()[2] == 16
    quiet = RerunStateMachine(
        RerunStateMachineConfig(rerun_mode="validate_results", check_for_nan_in_loss=False)
    )
    while quiet.should_run_forward_backward(data):
        next(data)
        quiet.validate_loss(torch.tensor(float("nan")))
    assert quiet.should_checkpoint_and_exit() == (False, False, 0)


def test_spiky_loss():
    machine = RerunStateMachine()
    for i in range(100):
        assert not machine.is_unexpectedly_large(1.0 + 0.01 * i, 10, "loss")
    assert machine.is_unexpectedly_large(20 * 1.99, 10, "loss")  # 20x flagged
    assert not machine.is_unexpectedly_large(5 * 1.99, 10, "loss")  # 5x not


def test_report_stats_reruns_every_step_without_stopping():
    machine = RerunStateMachine(RerunStateMachineConfig(rerun_mode="report_stats"))
    data = RerunDataIterator(range(100))
    for _ in range(5):
        runs = 0
        while machine.should_run_forward_backward(data):
            x = next(data)
            machine.validate_result(torch.tensor(float(x)) + torch.rand(()), torch.isnan)
            runs += 1
        assert runs == 2 and machine.should_checkpoint_and_exit() == (False, False, 0)
    stats = machine.get_stats()
    assert stats["count"] == 5 and stats["max"] == 0.0  # RNG restored: deterministic


def test_bad_config():
    with pytest.raises(ConfigError, match="rerun_mode"):
        RerunStateMachineConfig(rerun_mode="sometimes")
    with pytest.raises(ConfigError, match="error_injection_type"):
        RerunStateMachineConfig(error_injection_type="cosmic_ray")
    with pytest.raises(ConfigError, match="rerun state"):
        RerunStateMachine().load_state_dict({"state": 9, "iteration": 0, "initial": []})
    with pytest.raises(ConfigError, match="rerun state"):
        RerunStateMachine().load_state_dict({"iteration": 0})


def test_the_states_transitions_are_the_ones_drawn_and_no_other():
    """The table that check() enforces is the one the module docstring draws (issue 69:
    the transitions were scattered through should_run_forward_backward)."""
    import re

    from steadfast.rerun import states

    drawn = {
        (states.RerunState[a], states.RerunState[b])
        for a, b in re.findall(r"^\s+([A-Z_]+)\s+-> ([A-Z_]+)", states.__doc__ or "", re.M)
    }
    assert drawn == set(states.TRANSITIONS)
    with pytest.raises(AssertionError, match="NOT_RUNNING_YET -> RERUNNING_FROM_CHECKPOINT"):
        states.check(states.RerunState.NOT_RUNNING_YET, states.RerunState.RERUNNING_FROM_CHECKPOINT)
