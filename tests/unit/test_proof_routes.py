"""The ledger route of a restore's proof (steadfast.checkpoint.proof_route) in one
process, each start a fresh CheckpointManager as a restarted worker's: after a restore
the run proved by replay, a disk checkpoint proven by the digest logged at its save,
with no step re-done; a checkpoint that is not the one saved under its name refuted;
a state of other keys not proven by it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from sfharness import read_events
from steadfast import CheckpointManager, events
from steadfast.checkpoint.proof import RestoreMismatch, read_excluded
from steadfast.checkpoint.proof_log import digest, read_log


def _objects() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optim": opt}


def _train(mgr: CheckpointManager, objects: dict, start: int, stop: int, every: int) -> None:
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


def _kinds(log: Path, kind: str) -> list[dict]:
    return [e for e in read_events(log) if e["kind"] == kind]


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
