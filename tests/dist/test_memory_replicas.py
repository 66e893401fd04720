"""The memory tier across "nodes" in a real 2-rank gloo group: each rank has its own
memory directory and ``LOCAL_WORLD_SIZE=1``, as two nodes would, so each snapshot is
replicated to the other rank in the background. A rank whose own snapshots are gone (its
node lost) restores from the replica its peer sends; a damaged replica is caught after
the transfer and the ranks agree on an older step; the disk is read only when no
memory tier has a step every rank can restore."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sfharness import read_events, run_ranks


def _model(value: float) -> torch.nn.Linear:
    net = torch.nn.Linear(4, 3)
    with torch.no_grad():
        net.weight.fill_(value)
        net.bias.fill_(-value)
    return net


def _train(rank: int, world: int, workdir: Path, ckpt: str, lose: str) -> dict:
    import shutil

    from steadfast import CheckpointManager

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["STEADFAST_MEMORY_DIR"] = str(workdir / f"mem_{rank}")
    os.environ["STEADFAST_EVENTS"] = str(workdir / f"events_{rank}.jsonl")
    (workdir / f"mem_{rank}").mkdir(exist_ok=True)
    net = _model(0.0)
    mgr = CheckpointManager(ckpt, memory_every=1)
    for step in range(1, 5):
        with torch.no_grad():
            net.weight.add_(1.0 + rank)
        mgr.snapshot(step, {"model": net}, {"who": torch.tensor([rank, step])})
        if step == 2:
            mgr.save(step, {"model": net}, {"who": torch.tensor([rank, step])})
    mgr.close()  # the last snapshot and its replica are written
    if rank == 1 and lose in ("node", "node+replica"):  # rank 1's node is gone
        shutil.rmtree(workdir / "mem_1")
        (workdir / "mem_1").mkdir()
    torch.distributed.barrier()
    if rank == 0 and lose == "node+replica":  # and the replica of step 4 is damaged
        (replica,) = (workdir / "mem_0").glob("*/replica/rank_1/step_4/state.pt")
        data = bytearray(replica.read_bytes())
        data[len(data) // 2] ^= 0xFF
        replica.write_bytes(bytes(data))
    torch.distributed.barrier()
    fresh = _model(-1.0)
    again = CheckpointManager(ckpt, memory_every=1)
    step, state = again.restore({"model": fresh})
    again.close()
    return {
        "step": step,
        "who": state["who"].tolist(),
        "weight": fresh.weight.detach().clone(),
        "expected": net.weight.detach().clone(),
    }


def _events(workdir: Path, rank: int, kind: str) -> list[dict]:
    return [e for e in read_events(workdir / f"events_{rank}.jsonl") if e["kind"] == kind]


def test_each_rank_restores_its_own_snapshot_from_memory(tmp_path):
    work = tmp_path / "w"
    results = run_ranks(_train, work, args=(str(tmp_path / "ck"), "none"), timeout=120)
    for rank, got in enumerate(results):
        assert got["step"] == 4 and got["who"] == [rank, 4]
        assert torch.equal(got["weight"], got["expected"])
        (loaded,) = _events(work, rank, "checkpoint_loaded")
        assert loaded["tier"] == "memory" and loaded["from_rank"] == rank


def test_a_lost_node_restores_from_the_replica_on_its_peer(tmp_path):
    work = tmp_path / "w"
    results = run_ranks(_train, work, args=(str(tmp_path / "ck"), "node"), timeout=120)
    for rank, got in enumerate(results):
        assert got["step"] == 4 and got["who"] == [rank, 4]
        assert torch.equal(got["weight"], got["expected"])
    (loaded,) = _events(work, 1, "checkpoint_loaded")
    assert loaded["tier"] == "replica" and loaded["from_rank"] == 0  # sent by rank 0


def test_a_damaged_replica_is_caught_and_an_older_step_restored(tmp_path):
    """Rank 1's node is lost and rank 0's replica of its newest snapshot is damaged: the
    transfer is verified, the copy rejected (``checkpoint_corrupt``, cause ``replica``)
    and both ranks go back to step 3, the newest step every rank can still restore."""
    work = tmp_path / "w"
    results = run_ranks(_train, work, args=(str(tmp_path / "ck"), "node+replica"), timeout=120)
    assert [got["step"] for got in results] == [3, 3]
    assert [got["who"] for got in results] == [[0, 3], [1, 3]]
    corrupt = _events(work, 1, "checkpoint_corrupt")  # found where it arrived
    assert corrupt and corrupt[0]["cause"] == "replica" and "checksum" in corrupt[0]["reason"]
    tiers = [_events(work, r, "checkpoint_loaded")[0]["tier"] for r in (0, 1)]
    assert tiers == ["memory", "replica"]


def _failing_write(rank: int, world: int, workdir: Path, ckpt: str) -> dict:
    from steadfast import CheckpointManager
    from steadfast.checkpoint import CheckpointError

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["STEADFAST_MEMORY_DIR"] = str(workdir / f"mem_{rank}")
    os.environ["STEADFAST_EVENTS"] = "off"
    (workdir / f"mem_{rank}").mkdir(exist_ok=True)
    mgr = CheckpointManager(ckpt, memory_every=1)
    errors = []
    for step in range(1, 5):
        state = {"w": torch.full((4,), float(step))}
        if rank == 0 and step == 2:
            state["bad"] = lambda: None  # cannot be pickled: the background write fails
        try:
            mgr.snapshot(step, state)
        except CheckpointError as exc:
            errors.append((step, str(exc)))
    mgr.close()
    again = CheckpointManager(ckpt, memory_every=1)
    step, state = again.load()
    again.close()
    return {"errors": errors, "step": step, "w": state["w"].tolist()}


def test_a_failed_write_still_takes_its_turn_in_the_replica_exchange(tmp_path):
    """Rank 0's snapshot of step 2 cannot be written: it exchanges an empty replica
    (rank 1 does not wait for it), the error is raised at its next snapshot (step 3),
    the ranks go on in step, and the newest snapshot restores."""
    results = run_ranks(_failing_write, tmp_path / "w", args=(str(tmp_path / "ck"),), timeout=90)
    assert [s for s, _ in results[0]["errors"]] == [3] and "memory snapshot" in results[0][
        "errors"
    ][0][1]
    assert results[1]["errors"] == []
    assert [r["step"] for r in results] == [4, 4] and results[0]["w"] == [4.0] * 4


def test_only_this_jobs_snapshots_are_offered(tmp_path, monkeypatch):
    """A manifest naming another job (say, copied in by hand) is never restored."""
    import json

    from steadfast import CheckpointManager

    monkeypatch.setenv("STEADFAST_MEMORY_DIR", str(tmp_path))
    monkeypatch.setenv("STEADFAST_EVENTS", "off")
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        mgr.snapshot(3, {"w": torch.ones(2)})
    (manifest,) = tmp_path.glob("*/own/rank_0/step_3/manifest.json")
    data = json.loads(manifest.read_text())
    data["job"] = "another-job|" + data["job"].split("|", 1)[1]
    manifest.write_text(json.dumps(data))
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        assert mgr.load() is None
