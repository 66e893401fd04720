"""The replay proof of a restore (steadfast.checkpoint.proof) in one process: a loop that
logs its losses and saves every 2 steps, stopped, then started again by a fresh
CheckpointManager, as a restarted worker would be. And the ledger route: after a restore
the run proved by replay, a disk checkpoint proven by the digest logged at its save,
with no step re-done; one that is not the checkpoint saved under its name refuted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from sfharness import read_events
from steadfast import CheckpointError, CheckpointManager, ConfigError, events
from steadfast.checkpoint.proof import (
    EXCLUDED_FILE,
    RestoreMismatch,
    RestoreUnproven,
    ceiling,
    logged_losses,
    read_excluded,
)
from steadfast.checkpoint.proof_log import digest, read_log
from steadfast.rerun import RerunStateMachine
from steadfast.rerun.machine import destroy_rerun_state_machine, initialize_rerun_state_machine


def _objects() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optim": opt}


def _train(mgr: CheckpointManager, objects: dict, start: int, stop: int, every: int = 2) -> None:
    """Steps ``start`` to ``stop - 1``: each logs its loss; a save every ``every``."""
    model, opt = objects["model"], objects["optim"]
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        events.emit("step_done", step=step, seconds=0.001, loss=loss.item())
        if (step + 1) % every == 0:
            mgr.save(step + 1, objects)


def _first_run(folder: Path) -> None:
    with CheckpointManager(folder) as mgr:
        objects = _objects()
        assert mgr.restore(objects) is None
        _train(mgr, objects, 0, 7)  # saves 2, 4, 6; losses of steps 0-6 logged


def _kinds(log: Path, kind: str) -> list[dict]:
    return [e for e in read_events(log) if e["kind"] == kind]


def test_with_too_few_logged_steps_the_one_before_is_restored_and_compared_with_it(
    tmp_path, event_log
):
    """Steps 0-6 logged, checkpoints 2, 4, 6: step 6 leaves one logged step, so step 4
    is restored, and the state the loop reaches at step 6 is compared with step 6's."""
    _first_run(tmp_path / "ck")
    with CheckpointManager(tmp_path / "ck") as mgr:
        objects = _objects()
        step, _ = mgr.restore(objects)
        assert step == 4
        _train(mgr, objects, 4, 9)
    [verified] = _kinds(event_log, "restore_verified")
    assert (verified["step"], verified["tier"], verified["route"]) == (4, "disk", "state")
    assert verified["against"] == str(tmp_path / "ck" / "step_6")
    assert verified["steps"] == [4, 5] and verified["proof_steps"] == 2
    # nothing was saved from the unproven state: 6 is written again once it is proven
    saved = [e["step"] for e in _kinds(event_log, "checkpoint_saved")]
    assert saved == [2, 4, 6, 6, 8]


def test_three_logged_steps_after_the_newest_prove_it_by_their_losses(tmp_path, event_log):
    with CheckpointManager(tmp_path / "ck") as mgr:
        objects = _objects()
        _train(mgr, objects, 0, 11, every=4)  # saves 4, 8; losses 8, 9, 10 logged after 8
    with CheckpointManager(tmp_path / "ck") as mgr:
        objects = _objects()
        assert mgr.restore(objects)[0] == 8
        _train(mgr, objects, 8, 12, every=4)
    [verified] = _kinds(event_log, "restore_verified")
    assert (verified["step"], verified["route"], verified["steps"]) == (8, "losses", [8, 9, 10])
    assert verified["proof_steps"] == 0 and verified["against"] is None


def test_a_state_that_differs_is_a_mismatch_then_nothing_is_left_to_trust(
    tmp_path, event_log, monkeypatch
):
    """Each start is a new generation of workers (as the launcher numbers them): the
    losses a bad restore logged are not the truth the next start compares with."""
    _first_run(tmp_path / "ck")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    machine = initialize_rerun_state_machine(mode="validate_results")
    try:
        with CheckpointManager(tmp_path / "ck") as mgr:
            objects = _objects()
            mgr.restore({"model": objects["model"]})  # the optimizer's momentum is lost
            with pytest.raises(RestoreMismatch, match=r"restore of step 4 .* rank 0's step 5"):
                _train(mgr, objects, 4, 9)
        assert machine.verdicts == ["bad_restore"]  # told, not "a bad GPU"
    finally:
        destroy_rerun_state_machine()
    [mismatch] = _kinds(event_log, "restore_mismatch")
    assert (mismatch["step"], mismatch["tier"]) == (4, "disk")
    # step 4 used no momentum: step 5's loss differs, and the state at step 6
    assert mismatch["differs"] == [
        {"rank": 0, "step": 5, "loss": mismatch["differs"][0]["loss"],
         "logged": mismatch["differs"][0]["logged"]},
        {"rank": 0, "step": 6, "objects": ["model", "optim"]},
    ]  # fmt: skip
    # restored step 4 or compared step 6: either may be wrong, both are distrusted
    assert read_excluded(tmp_path / "ck") == {"disk": 6}
    # the next start: every disk checkpoint up to 6 is excluded
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with CheckpointManager(tmp_path / "ck") as mgr, pytest.raises(RestoreUnproven) as stop:
        mgr.restore(_objects())
    assert stop.value.code == 17 and "disk up to step 6" in str(stop.value)


def _snapshot_every_step(mgr: CheckpointManager, objects: dict, start: int, stop: int) -> None:
    """Steps ``start`` to ``stop - 1`` with a LambdaLR: each logs its loss, snapshots
    the model and the optimizer (not the scheduler, which a test may leave out of the
    restore) every step, and saves to disk every 4."""
    sched = objects["sched"]
    state = {"model": objects["model"], "optim": objects["optim"]}
    if "forget" not in objects:
        state["sched"] = sched
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        objects["optim"].zero_grad()
        loss = torch.nn.functional.mse_loss(objects["model"](x), y)
        loss.backward()
        objects["optim"].step()
        sched.step()
        events.emit("step_done", step=step, seconds=0.001, loss=loss.item())
        mgr.snapshot(step + 1, state)
        if (step + 1) % 4 == 0:
            mgr.save(step + 1, state)


def _with_scheduler(forget: bool = False) -> dict:
    objects = _objects()
    objects["sched"] = torch.optim.lr_scheduler.LambdaLR(objects["optim"], lambda n: 1 / (n + 1))
    if forget:
        objects["forget"] = True
    return objects


@pytest.fixture
def memory_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    mem = tmp_path / "mem"
    mem.mkdir()
    monkeypatch.setenv("STEADFAST_MEMORY_DIR", str(mem))
    return mem


def test_with_a_snapshot_every_step_one_step_is_re_done_and_compared_with_the_newest(
    tmp_path, event_log, memory_dir
):
    """Snapshots 1-7 (disk 4), losses of steps 0-6 logged: a proof by the losses would
    go back to step 4 (three logged steps after it). The memory route restores snapshot
    6 and compares the state the loop reaches at step 7 with snapshot 7: one step
    re-done, proven bit for bit."""
    with CheckpointManager(tmp_path / "ref", memory_every=1, max_proof_steps=0) as mgr:
        reference = _with_scheduler()
        _snapshot_every_step(mgr, reference, 0, 9)  # the fault-free run
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        _snapshot_every_step(mgr, _with_scheduler(), 0, 7)
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        again = _with_scheduler()
        state = {k: again[k] for k in ("model", "optim", "sched")}
        assert mgr.restore(state)[0] == 6
        _snapshot_every_step(mgr, again, 6, 9)
    [verified] = _kinds(event_log, "restore_verified")
    assert (verified["step"], verified["tier"], verified["route"]) == (6, "memory", "state")
    assert verified["proof_steps"] == 1 and verified["steps"] == [6] and verified["exact"]
    restored = Path(verified["path"])  # <memory dir>/<key>/own/rank_0/step_6
    assert restored.is_relative_to(memory_dir) and restored.name == "step_6"
    assert verified["against"] == str(restored.with_name("step_7"))
    # the proof read snapshot 7 without announcing a restore
    assert [(e["step"], e["tier"]) for e in _kinds(event_log, "checkpoint_loaded")] == [
        (6, "memory")
    ]
    # snapshot 7 was kept for the comparison, then written again once proven
    assert sorted(p.name for p in restored.parent.glob("step_*")) == [
        f"step_{n}" for n in range(5, 10)
    ]
    for key, value in again["model"].state_dict().items():  # bit for bit
        assert torch.equal(value, reference["model"].state_dict()[key]), key


def test_a_state_the_snapshots_lack_is_caught_one_step_after_the_restore(
    tmp_path, event_log, memory_dir
):
    """The loop snapshots no LR scheduler: after the restore of snapshot 6 the fresh
    scheduler sets another rate at step 7, and the optimizer's state there differs
    from snapshot 7's (a proof by the losses would have seen it at the third)."""
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        _snapshot_every_step(mgr, _with_scheduler(forget=True), 0, 7)
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        again = _with_scheduler(forget=True)
        assert mgr.restore({"model": again["model"], "optim": again["optim"]})[0] == 6
        said = r"restore of step 6 .* differs from the memory tier's snapshot of step 7 in optim"
        with pytest.raises(RestoreMismatch, match=said):
            _snapshot_every_step(mgr, again, 6, 9)
    [mismatch] = _kinds(event_log, "restore_mismatch")
    assert (mismatch["step"], mismatch["tier"]) == (6, "memory")
    assert mismatch["differs"] == [{"rank": 0, "step": 7, "objects": ["optim"]}]
    # the restored snapshot or the compared one: either may be wrong, both distrusted
    assert read_excluded(tmp_path / "ck") == {"memory": 7}


def test_a_loop_that_logs_no_loss_is_restored_unverified(tmp_path, event_log):
    with CheckpointManager(tmp_path / "ck") as mgr:
        objects = _objects()
        mgr.save(2, objects)
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.restore(_objects())[0] == 2  # the newest: nothing to prove it with
    [unverified] = _kinds(event_log, "restore_unverified")
    assert unverified["step"] == 2 and "logged steps" in unverified["reason"]


def test_logged_losses_are_the_newest_of_good_generations(tmp_path):
    log = tmp_path / "events.jsonl"
    now = time.time()

    def line(kind: str, at: float, restart: int, **fields) -> str:
        return json.dumps({"kind": kind, "time": at, "restart": restart, **fields})

    log.write_text(
        "\n".join(
            [
                line("step_done", now - 9, 0, rank=0, step=4, loss=1.0),
                line("step_done", now - 8, 0, rank=1, step=4, loss=2.0),
                line("step_done", now - 7, 0, rank=0, step=5, loss="nan"),
                line("step_done", now - 6, 1, rank=0, step=5, loss=0.5),  # re-done after a NaN
                line("step_done", now - 5, 2, rank=0, step=4, loss=9.0),  # a bad restore's
                line("restore_mismatch", now - 4, 2, rank=0, step=4),
                line("step_done", now + 1, 3, rank=0, step=6, loss=3.0),  # after `before`
                line("step_done", now - 3, 0, rank=0, step=7),  # no loss
                '{"kind": "step_done", "time": 1.0, "ra',  # cut by a crash
            ]
        )
        + "\n"
    )
    losses = logged_losses(str(log), now)
    assert losses == {0: {4: 1.0, 5: 0.5}, 1: {4: 2.0}}
    assert ceiling(losses) is None  # two steps logged: fewer than three
    assert ceiling({0: {3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0}}) == 4
    assert logged_losses(str(tmp_path / "none.jsonl"), now) == {}


def test_a_damaged_exclusion_file_is_one_error_naming_it(tmp_path):
    (tmp_path / EXCLUDED_FILE).write_text('{"disk": "four"}')
    with pytest.raises(CheckpointError, match=EXCLUDED_FILE):
        read_excluded(tmp_path)
    (tmp_path / EXCLUDED_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="delete it to trust every tier"):
        read_excluded(tmp_path)


def test_a_machine_told_of_a_bad_restore_gives_no_hardware_verdict():
    machine = RerunStateMachine(mode="validate_results")
    machine.bad_restore = "the restore of step 4 failed its replay proof"
    machine._verdict("persistent", "Second rerun: not reproducible\nPossible persistent error!")
    assert machine.verdicts == ["bad_restore"]


def test_max_proof_steps_zero_turns_the_proofs_off(tmp_path, event_log):
    _first_run(tmp_path / "ck")
    with CheckpointManager(tmp_path / "ck", max_proof_steps=0) as mgr:
        objects = _objects()
        assert mgr.restore(objects)[0] == 6  # the newest, as before proofs
        _train(mgr, objects, 6, 9)
    assert not [e for e in read_events(event_log) if e["kind"].startswith("restore_")]
    assert [e["step"] for e in _kinds(event_log, "checkpoint_saved")] == [2, 4, 6, 8]
    with pytest.raises(ConfigError, match="max_proof_steps"):
        CheckpointManager(tmp_path / "ck", max_proof_steps=-1)


def _swap(first: Path, second: Path) -> None:
    """Swap two checkpoints' folders, each whole and consistent in itself (its
    manifest's step set to its new name's)."""
    aside = first.with_name(".swap")
    first.rename(aside)
    second.rename(first)
    aside.rename(second)
    for folder in (first, second):
        manifest = folder / "manifest.json"
        data = json.loads(manifest.read_text())
        data["step"] = int(folder.name.split("_")[1])
        manifest.write_text(json.dumps(data))


def _proven_once(folder: Path) -> None:
    """A run that saves 2, 4, 6; a restart proven by replay (step 4 against 6) that
    goes on to save 6 and 8: the run's log then holds a restore proven by replay."""
    with CheckpointManager(folder) as mgr:
        _train(mgr, _objects(), 0, 7, every=2)
    with CheckpointManager(folder) as mgr:
        objects = _objects()
        assert mgr.restore(objects)[0] == 4
        _train(mgr, objects, 4, 9, every=2)


def test_after_a_restore_proven_by_replay_the_ledger_proves_the_next_with_none_redone(
    tmp_path, event_log
):
    _proven_once(tmp_path / "ck")
    with CheckpointManager(tmp_path / "ck") as mgr:
        objects = _objects()
        assert mgr.restore(objects)[0] == 8  # the newest: no step re-done
        _train(mgr, objects, 8, 10, every=2)
    first, second = _kinds(event_log, "restore_verified")
    assert first["route"] == "state" and first["keys"] == ["model", "optim", "rng"]
    assert (second["step"], second["route"], second["proof_steps"]) == (8, "ledger", 0)
    saved = {e["path"]: e["digest"] for e in _kinds(event_log, "checkpoint_saved")}
    assert second["digest"] == saved[str(tmp_path / "ck" / "step_8")]
    assert second["keys"] == first["keys"]
    # nothing held back: the save of step 10 is the next one
    assert [e["step"] for e in _kinds(event_log, "checkpoint_saved")][-1] == 10


def test_a_checkpoint_swapped_after_its_save_fails_the_ledger(tmp_path, event_log):
    _proven_once(tmp_path / "ck")
    _swap(tmp_path / "ck" / "step_8", tmp_path / "ck" / "step_6")
    swapped = r"restore of step 8 .* digest .* swapped"
    with CheckpointManager(tmp_path / "ck") as mgr, pytest.raises(RestoreMismatch, match=swapped):
        mgr.restore(_objects())
    [mismatch] = _kinds(event_log, "restore_mismatch")
    assert (
        mismatch["step"] == 8
        and mismatch["differs"][0]["logged"] != (mismatch["differs"][0]["digest"])
    )
    assert read_excluded(tmp_path / "ck") == {"disk": 8}


def test_the_ledger_does_not_prove_a_state_with_other_keys(tmp_path, event_log):
    """The earlier proof showed the checkpoints hold every state the loop depends on
    for the keys it had; a restore of other keys is not proven by it."""
    _proven_once(tmp_path / "ck")
    with CheckpointManager(tmp_path / "ck") as mgr:
        objects = _objects()
        mgr.save(10, {"model": objects["model"]})  # the optimizer left out
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.restore({"model": _objects()["model"]})[0] == 10
    [unverified] = _kinds(event_log, "restore_unverified")
    assert unverified["step"] == 10 and "keys (model, rng)" in unverified["reason"]


def test_the_log_names_the_last_replay_proof_that_nothing_refuted_and_the_ledger(tmp_path):
    log = tmp_path / "events.jsonl"
    now = time.time()

    def line(kind: str, at: float, **fields) -> str:
        return json.dumps({"kind": kind, "time": at, **fields})

    lines = [
        line("checkpoint_saved", now - 9, path="ck/step_2", digest="aa"),
        line("restore_verified", now - 8, route="state", keys=["model", "rng"]),
        line("checkpoint_saved", now - 7, path="ck/step_2", digest="bb"),  # saved again
        line("restore_verified", now - 6, route="ledger", keys=["other"]),  # not a replay
        line("checkpoint_saved", now - 5, path="ck/step_4"),  # a log from before digests
    ]
    log.write_text("\n".join(lines) + "\n")
    logged = read_log(str(log), now)
    assert logged.proven == ["model", "rng"] and logged.saved == {"ck/step_2": "bb"}
    log.write_text("\n".join([*lines, line("restore_mismatch", now - 4, step=2)]) + "\n")
    assert read_log(str(log), now).proven is None  # refuted since
    assert read_log(str(log), now - 8.5).proven is None  # not yet logged then
    assert digest({"b": {"bytes": 1, "crc32": 2}, "a": {"bytes": 3, "crc32": 4}}) != digest(
        {"b": {"bytes": 1, "crc32": 2}, "a": {"bytes": 3, "crc32": 5}}
    )


def test_no_proof_across_a_change_of_the_world_size(tmp_path, event_log):
    """An elastic round that goes on with fewer ranks re-does the steps with the batch
    split another way: the newest checkpoint is restored, said unverified, never a
    mismatch (seen on the bed: --nnodes 1:2, a node lost, the survivor's state route
    compared its re-done state with a checkpoint of two ranks, then exit 17)."""
    _first_run(tmp_path / "ck")  # saves 2, 4, 6, as if by two ranks:
    for manifest in (tmp_path / "ck").glob("step_*/manifest.json"):
        data = json.loads(manifest.read_text())
        data["world_size"] = 2
        manifest.write_text(json.dumps(data))
    with CheckpointManager(tmp_path / "ck") as mgr:
        objects = _objects()
        assert mgr.restore(objects)[0] == 6  # not 4: nothing to compare with
        _train(mgr, objects, 6, 9)
    [unverified] = _kinds(event_log, "restore_unverified")
    assert "world size changed" in unverified["reason"] and "2 -> 1" in unverified["reason"]
    assert not _kinds(event_log, "restore_mismatch")
