"""The re-run state machine on 2 real gloo ranks with a deterministic toy model (DDP,
dropout, two micro-batches a step): a fault on rank 1 is attributed as transient,
persistent or correct, the replayed micro-batches are the first run's, and every run that
goes on ends with the fault-free parameters bit for bit.

Faults are real wrong numbers, not the machine's own injection: a NaN loss that appears
on the first attempt only (transient), a NaN on "node-a" only (persistent: the restart
on "node-b", faked with ``STEADFAST_RERUN_HARDWARE_ID``, does not reproduce it), and a
20x loss spike that is in the data (correct).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import read_events, run_ranks

STEPS, FAULT_STEP = 56, 52  # 50 steps x 2 micro-batches = the 100 samples of the spike check
MICRO = 2


class _Stream:
    """This rank's micro-batches in order; its position goes into the checkpoint."""

    def __init__(self, rank: int, spike: bool) -> None:
        self.rank, self.spike, self.pos = rank, spike, 0

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.pos + self.rank)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if self.spike and self.rank == 1 and self.pos == FAULT_STEP * MICRO:
            y = y * 50  # a real outlier in the data: the loss is ~20x or more
        self.pos += 1
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])


def _train(rank: int, world: int, workdir: Path, ckpt: str, fault: str, mode: str):
    import os

    from torch.nn.parallel import DistributedDataParallel as DDP

    from steadfast import CheckpointManager
    from steadfast.rerun import RerunDataIterator, RerunStateMachine, RerunStateMachineConfig

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    fatal = fault == "transient_fatal"
    machine = RerunStateMachine(
        RerunStateMachineConfig(
            rerun_mode=mode,
            check_for_nan_in_loss=fatal,  # the seed's check (fatal); the others: not fatal
            check_for_spiky_loss=True,
            result_rejected_tracker_filename=str(workdir / "tracker.jsonl"),
        )
    )
    stream = _Stream(rank, spike=fault == "correct")
    mgr = CheckpointManager(ckpt)
    restored = mgr.restore({"model": net, "optim": opt, "rerun": machine, "data": stream})
    start = restored[0] if restored else 0
    data = RerunDataIterator(stream)
    hardware = os.environ.get("STEADFAST_RERUN_HARDWARE_ID", "")
    seen: list[tuple[int, int, list[float]]] = []  # step, attempt, micro-batch checksums
    snapshot = None
    code = 0
    step = start
    while step < STEPS:
        attempt = 0
        while machine.should_run_forward_backward(data):
            opt.zero_grad()
            sums = []
            for _ in range(MICRO):
                x, y = next(data)
                sums.append(float(x.sum() + y.sum()))
                loss = torch.nn.functional.mse_loss(model(x), y) / MICRO
                bad = rank == 1 and step == FAULT_STEP
                if bad and (
                    (fault.startswith("transient") and attempt == 0)
                    or (fault == "persistent" and hardware == "node-a")
                ):
                    loss = loss * float("nan")  # this GPU computed garbage
                loss.backward()
                if not fatal:
                    machine.validate_result(loss, torch.isnan, "loss is NaN", fatal=False)
                machine.validate_loss(loss)
            seen.append((step, attempt, sums))
            attempt += 1
        should_checkpoint, should_exit, code = machine.should_checkpoint_and_exit()
        if should_checkpoint:
            state = {"model": net, "optim": opt}
            mgr.save(step, state, rank_state={"rerun": machine, "data": stream})
        if should_exit:
            break
        opt.step()
        step += 1
        if step == FAULT_STEP:
            snapshot = [p.detach().clone() for p in net.parameters()]
    mgr.close()
    params = [p.detach().clone() for p in net.parameters()]
    return {
        "code": code,
        "start": start,
        "stopped_at": step,
        "params": params,
        "snapshot": snapshot,
        "seen": seen,
        "verdicts": machine.verdicts,
    }


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _with_reference(rank: int, world: int, workdir: Path, ckpt: str, fault: str, mode: str):
    """The fault-free run first (the same data, the machine disabled, which must change
    nothing), then the run under test, in the same processes (one start-up, not two)."""
    data = "correct" if fault == "correct" else "none"
    ref = _train(rank, world, workdir, f"{ckpt}_ref", data, "disabled")
    assert ref["seen"] == [(s, 0, ref["seen"][s][2]) for s in range(STEPS)]  # once each
    return ref, _train(rank, world, workdir, ckpt, fault, mode)


def _elsewhere(rank: int, world: int, workdir: Path, ckpt: str, fault: str):
    """On "node-a": the reference, then the run that exits 16 with a checkpoint; then,
    as after a restart on "node-b", a fresh model, optimizer and machine restored from that
    checkpoint (a new process would do the same: the launcher test shows that path)."""
    import os

    os.environ["STEADFAST_RERUN_HARDWARE_ID"] = "node-a"
    ref, first = _with_reference(rank, world, workdir, ckpt, fault, "validate_results")
    os.environ["STEADFAST_RERUN_HARDWARE_ID"] = "node-b"
    return ref, first, _train(rank, world, workdir, ckpt, fault, "validate_results")


def _tracker(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "tracker.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _replays_are_identical(seen: list[tuple[int, int, list[float]]]) -> None:
    by_step: dict[int, list[list[float]]] = {}
    for step, _attempt, sums in seen:
        by_step.setdefault(step, []).append(sums)
    for runs in by_step.values():
        assert all(r == runs[0] for r in runs)


@pytest.mark.parametrize("fatal", [True, False])
def test_transient_error_is_not_reproduced_in_place(tmp_path: Path, event_log: Path, fatal: bool):
    fault = "transient_fatal" if fatal else "transient"
    runs = run_ranks(
        _with_reference, tmp_path / "run", args=(str(tmp_path / "ckpt"), fault, "validate_results")
    )
    for ref, out in runs:
        assert out["verdicts"] == ["transient"]  # every rank, the same verdict
        assert [a for s, a, _ in out["seen"] if s == FAULT_STEP] == [0, 1]  # re-run in place
        _replays_are_identical(out["seen"])
        if fatal:  # exit 17, before the bad step's update, without a checkpoint
            assert (out["code"], out["stopped_at"]) == (17, FAULT_STEP)
            assert _equal(out["params"], ref["snapshot"])
        else:  # training went on with the re-run's (correct) gradients
            assert (out["code"], out["stopped_at"]) == (0, STEPS)
            assert _equal(out["params"], ref["params"])
    assert not (tmp_path / "ckpt" / "latest").exists()
    events = read_events(event_log)
    rejected = [e for e in events if e["kind"] == "rerun_result_rejected"]
    # both micro-batches' losses of the bad step, on rank 1 only, in its first run only
    assert [(e["rank"], e["step"], e["invocation"]) for e in rejected] == [
        (1, FAULT_STEP, 1), (1, FAULT_STEP, 4 if fatal else 3)]  # fmt: skip
    assert rejected[0]["cause"] == ("found NaN in local forward loss calculation" if fatal
                                    else "loss is NaN")  # fmt: skip
    verdicts = [e for e in events if e["kind"] == "rerun_verdict"]
    assert sorted(e["rank"] for e in verdicts) == [0, 1] and verdicts[0]["cause"] == "transient"
    track = _tracker(tmp_path / "run")
    assert [r["rank"] for r in track if r["status"] == "rejected"] == [1] * MICRO
    assert {r["status"] for r in track} == {"rejected", "transient"}


@pytest.mark.parametrize(
    ("fault", "verdict"), [("persistent", "persistent"), ("correct", "correct")]
)
def test_reproduced_in_place_restarts_elsewhere_and_the_second_rerun_decides(
    tmp_path: Path, event_log: Path, fault: str, verdict: str
):
    runs = run_ranks(_elsewhere, tmp_path / "run1", args=(str(tmp_path / "ckpt"), fault))
    ref = runs[0][0]
    first = [r[1] for r in runs]
    second = [r[2] for r in runs]
    for out in first:  # reproduced in place: checkpoint and exit 16, no update applied
        assert (out["code"], out["stopped_at"], out["verdicts"]) == (16, FAULT_STEP, [])
        assert _equal(out["params"], ref["snapshot"])
    for before, out in zip(first, second, strict=True):
        assert out["start"] == FAULT_STEP and out["verdicts"] == [verdict]
        assert out["code"] == 0 and out["stopped_at"] == STEPS
        # the step was re-run once more with the very micro-batches of the first run
        assert out["seen"][0][:2] == (FAULT_STEP, 0)
        assert out["seen"][0][2] == before["seen"][-1][2] == before["seen"][-2][2]
        assert _equal(out["params"], ref["params"])
    events = read_events(event_log)
    assert [e["rank"] for e in events if e["kind"] == "rerun_result_rejected"] == [1] * (
        MICRO if fault == "persistent" else 1)  # fmt: skip
    assert [e["cause"] for e in events if e["kind"] == "rerun_verdict"] == [verdict, verdict]
    statuses = [r["status"] for r in _tracker(tmp_path / "run1")]
    assert (
        statuses.count("rejected") == (MICRO if fault == "persistent" else 1)
        and statuses.count(verdict) == 2
    )
