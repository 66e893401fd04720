"""The memory tier with the shapes large jobs run: several ranks per node, replicated
(DDP-like) state kept once per node, and sharded (DTensor) state kept per rank, in a real
4-rank gloo group laid out as 2 "nodes" of 2 ranks (``LOCAL_WORLD_SIZE=2``, one memory
directory per node, as two hosts would have).

Each test loses node 1 (its memory directory emptied, as a spare replacing it would find
it) and restores: every rank gets the newest step bit for bit, node 1's ranks from node
0's replicas, with nothing read from disk. A world size that changed reads the disk
(DCP reshards), and says why."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from sfharness import read_events, run_ranks
from steadfast.checkpoint import ShardedTrainState

LOCAL = 2
RUN_ID = "memory-shapes"


def _node_env(rank: int, workdir: Path, world: int) -> Path:
    node = rank // LOCAL
    os.environ["LOCAL_WORLD_SIZE"] = str(min(LOCAL, world))
    os.environ["TORCHELASTIC_RUN_ID"] = RUN_ID
    mem = workdir / f"mem_node{node}"
    mem.mkdir(exist_ok=True)
    os.environ["STEADFAST_MEMORY_DIR"] = str(mem)
    os.environ["STEADFAST_EVENTS"] = str(workdir / f"events_{world}_{rank}.jsonl")
    return mem


def _held(mem: Path) -> list[str]:
    """The files of step 3's snapshots a node's memory directory holds (own, replica)."""
    return sorted(str(p.relative_to(mem)).split("/", 1)[1] for p in mem.glob("*/*/*/step_3/*.pt"))


def _lose_node_1(rank: int, workdir: Path) -> None:
    """Node 1's memory is gone (the node was lost; its spare starts empty)."""
    torch.distributed.barrier()
    if rank == LOCAL:
        shutil.rmtree(workdir / "mem_node1")
        (workdir / "mem_node1").mkdir()
    torch.distributed.barrier()


def _replicated(rank: int, world: int, workdir: Path, ckpt: str) -> dict:
    from steadfast import CheckpointManager

    mem = _node_env(rank, workdir, world)
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 32)  # the same on every rank, as DDP keeps it
    mgr = CheckpointManager(ckpt, memory_every=1)
    for step in range(1, 4):
        with torch.no_grad():
            net.weight.mul_(1.5).add_(0.25)
        mgr.snapshot(step, {"model": net}, {"who": torch.tensor([rank, step])})
    mgr.close()
    torch.distributed.barrier()
    # what node 0 holds: one state.pt per step of its own, one of node 1's replica
    held = _held(mem)
    expected = net.weight.detach().clone()
    _lose_node_1(rank, workdir)
    fresh = torch.nn.Linear(64, 32)
    again = CheckpointManager(ckpt, memory_every=1)
    step, state = again.restore({"model": fresh})
    again.close()
    return {
        "held": held,
        "step": step,
        "who": state["who"].tolist(),
        "equal": torch.equal(fresh.weight, expected),
    }


def _events(workdir: Path, world: int, rank: int, kind: str) -> list[dict]:
    log = workdir / f"events_{world}_{rank}.jsonl"
    return [e for e in read_events(log) if e["kind"] == kind]


def test_replicated_state_is_kept_once_per_node_and_a_lost_node_restores_from_replicas(
    tmp_path,
):
    work = tmp_path / "w"
    results = run_ranks(_replicated, work, 4, args=(str(tmp_path / "ck"),), timeout=180)
    # node 0 (ranks 0 and 1): its ranks' rank.pt, the state once (rank 0's), and node 1's
    # replicas (ranks 2 and 3), again with the state once
    assert results[0]["held"] == [
        "own/rank_0/step_3/rank.pt",
        "own/rank_0/step_3/state.pt",
        "own/rank_1/step_3/rank.pt",
        "replica/rank_2/step_3/rank.pt",
        "replica/rank_2/step_3/state.pt",
        "replica/rank_3/step_3/rank.pt",
    ]
    for rank, got in enumerate(results):
        assert got["step"] == 3 and got["who"] == [rank, 3] and got["equal"], (rank, got)
        (loaded,) = _events(work, 4, rank, "checkpoint_loaded")
        if rank < LOCAL:
            assert loaded["tier"] == "memory" and loaded["from_rank"] == rank
        else:  # node 1's ranks: their own pieces sent from node 0's replicas
            assert loaded["tier"] == "replica" and loaded["from_rank"] < LOCAL


def _sharded(rank: int, world: int, workdir: Path, ckpt: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from steadfast import CheckpointManager

    mem = _node_env(rank, workdir, world)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    weight = distribute_tensor(full.clone(), mesh, [Shard(0)])
    mgr = CheckpointManager(ckpt, memory_every=1)
    for step in range(1, 4):
        with torch.no_grad():
            weight.to_local().mul_(1.25).add_(float(step))
        mgr.snapshot(step, {"w": weight}, {"who": torch.tensor([rank, step])})
        if step == 2:
            mgr.save(step, {"w": weight}, {"who": torch.tensor([rank, step])})
    mgr.close()
    torch.distributed.barrier()
    held = _held(mem)
    expected = weight.full_tensor()
    _lose_node_1(rank, workdir)
    target = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
    again = CheckpointManager(ckpt, memory_every=1)
    step, state = again.restore({"w": target})
    again.close()
    return {
        "held": held,
        "step": step,
        "who": state["who"].tolist(),
        "equal": torch.equal(target.full_tensor(), expected),
        "same_object": state["w"] is target,
    }


def test_sharded_state_is_kept_per_rank_and_a_lost_node_restores_its_shards_from_replicas(
    tmp_path,
):
    work = tmp_path / "w"
    results = run_ranks(_sharded, work, 4, args=(str(tmp_path / "ck"),), timeout=180)
    # every rank keeps its own shards: each own and replica snapshot has a state.pt
    assert results[0]["held"] == [
        f"{tier}/rank_{r}/step_3/{f}"
        for tier, ranks in (("own", (0, 1)), ("replica", (2, 3)))
        for r in ranks
        for f in ("rank.pt", "state.pt")
    ]
    for rank, got in enumerate(results):
        assert got["step"] == 3 and got["who"] == [rank, 3], (rank, got)
        assert got["equal"] and got["same_object"], (rank, got)
        (loaded,) = _events(work, 4, rank, "checkpoint_loaded")
        assert loaded["tier"] == ("memory" if rank < LOCAL else "replica")


def _shrunk(rank: int, world: int, _: Path, ckpt: str, workdir: str) -> dict:
    """The same job on 2 ranks (an elastic shrink; its own rendezvous folder, the same
    nodes' memory): the memory tier's snapshots are of 4 ranks, so the disk checkpoint
    (step 2) is read, resharded by DCP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from steadfast import CheckpointManager

    _node_env(rank, Path(workdir), world)
    mesh = init_device_mesh("cpu", (world,))
    target = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
    again = CheckpointManager(ckpt, memory_every=1)
    step, _ = again.restore({"w": target})
    again.close()
    return {"step": step, "full": target.full_tensor()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_changed_world_size_reads_the_disk_through_dcp_and_says_why(tmp_path):
    work = tmp_path / "w"
    ckpt = str(tmp_path / "ck")
    run_ranks(_sharded, work, 4, args=(ckpt,), timeout=140)
    results = run_ranks(_shrunk, tmp_path / "w2", 2, args=(ckpt, str(work)), timeout=140)
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    for step in (1, 2):  # what the 4 ranks saved to disk at step 2
        full = full * 1.25 + float(step)
    for rank, got in enumerate(results):
        assert got["step"] == 2 and torch.equal(got["full"], full)
        (loaded,) = _events(work, 2, rank, "checkpoint_loaded")
        assert loaded["tier"] == "disk"
        assert "of 4 ranks, this job has 2" in loaded["reason"], loaded


def _fsdp_model(world: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(net[0])
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return net, opt


def _full(net) -> dict:
    return {k: v.full_tensor() for k, v in net.state_dict().items()}  # collective


def _fsdp_train(rank: int, world: int, workdir: Path, ckpt: str) -> dict:
    from steadfast import CheckpointManager

    _node_env(rank, workdir, world)
    net, opt = _fsdp_model(world)
    mgr = CheckpointManager(ckpt, memory_every=1)
    at_save = None
    for step in range(1, 4):
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g)
        torch.nn.functional.mse_loss(net(x), torch.zeros(4, 4)).backward()
        opt.step()
        mgr.snapshot(step, {"train": ShardedTrainState(net, opt)})
        if step == 2:
            mgr.save(step, {"train": ShardedTrainState(net, opt)})
            at_save = _full(net)
    mgr.close()
    expected = _full(net)
    if rank == 0:
        torch.save(at_save, workdir / "at_save.pt")
    _lose_node_1(rank, workdir)
    fresh, fresh_opt = _fsdp_model(world)
    again = CheckpointManager(ckpt, memory_every=1)
    step, _ = again.restore({"train": ShardedTrainState(fresh, fresh_opt)})
    again.close()
    got = _full(fresh)
    return {"step": step, "equal": all(torch.equal(got[k], v) for k, v in expected.items())}


def _fsdp_shrunk(rank: int, world: int, _: Path, ckpt: str, workdir: str) -> dict:
    from steadfast import CheckpointManager

    _node_env(rank, Path(workdir), world)
    net, opt = _fsdp_model(world)
    again = CheckpointManager(ckpt, memory_every=1)
    step, _ = again.restore({"train": ShardedTrainState(net, opt)})
    again.close()
    got = _full(net)
    saved = torch.load(Path(workdir) / "at_save.pt")
    return {"step": step, "equal": all(torch.equal(got[k], v) for k, v in saved.items())}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_state_restores_from_replicas_and_reshards_from_disk_on_fewer_ranks(tmp_path):
    """FSDP2 (``fully_shard``, with its optimizer as one ShardedTrainState): node 1 lost, its
    ranks' shards come from node 0's replicas, bit for bit; then the job on 2 ranks reads
    the disk checkpoint (the snapshots are of 4), resharded by DCP, and says why."""
    work = tmp_path / "w"
    ckpt = str(tmp_path / "ck")
    results = run_ranks(_fsdp_train, work, 4, args=(ckpt,), timeout=140)
    assert [(r["step"], r["equal"]) for r in results] == [(3, True)] * 4
    tiers = [_events(work, 4, r, "checkpoint_loaded")[0]["tier"] for r in range(4)]
    assert tiers == ["memory", "memory", "replica", "replica"]
    shrunk = run_ranks(_fsdp_shrunk, tmp_path / "w2", 2, args=(ckpt, str(work)), timeout=140)
    assert [(r["step"], r["equal"]) for r in shrunk] == [(2, True)] * 2
    for rank in range(2):
        (loaded,) = _events(work, 2, rank, "checkpoint_loaded")
        assert loaded["tier"] == "disk" and "of 4 ranks, this job has 2" in loaded["reason"]
