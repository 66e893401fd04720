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
