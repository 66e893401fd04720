"""Sharded state through DCP: a 2-rank DTensor round trip, verified, with fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sfharness import run_ranks


def _sharded(rank: int, world: int, workdir: Path, ckpt: str, async_save: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from steadfast import CheckpointError, CheckpointManager

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    weight = distribute_tensor(full.clone(), mesh, [Shard(0)])
    mgr = CheckpointManager(ckpt, async_save=async_save, keep_last_n=0)
    mgr.save(1, {"w": weight, "bias": torch.ones(3), "tag": "one"}, rank_state={"r": rank})
    weight.to_local().mul_(2)  # changed after the (async) snapshot: not in step 1
    mgr.save(2, {"w": weight, "bias": torch.ones(3) * 2, "tag": "two"}, rank_state={"r": rank})
    mgr.wait()
    out = {}
    files = sorted(p.name for p in (Path(ckpt) / "step_2" / "dcp").iterdir())
    out["files"] = files
    try:
        mgr.load()
    except CheckpointError as exc:
        out["load_error"] = str(exc)
    target = distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)])
    step, state = mgr.restore({"w": target, "bias": torch.zeros(3)})
    out["step2"] = (
        step,
        target.to_local().clone(),
        state["bias"].clone(),
        state["tag"],
        state["r"],
    )
    torch.distributed.barrier()
    if rank == 0:  # a flipped byte in one shard file of step 2
        shard = Path(ckpt) / "step_2" / "dcp" / [f for f in files if f.endswith(".distcp")][-1]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    target = distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)])
    step, state = mgr.restore({"w": target})
    out["fallback"] = (step, target.to_local().clone(), state["tag"])
    mgr.close()
    return out


@pytest.mark.parametrize("async_save", [False, True])
def test_dcp_round_trip_and_corrupt_shard_fallback(tmp_path: Path, event_log: Path, async_save):
    results = run_ranks(_sharded, tmp_path / "w", args=(str(tmp_path / "ckpt"), async_save))
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    manifest = json.loads((tmp_path / "ckpt" / "step_2" / "manifest.json").read_text())
    assert manifest["sharded"] is True and manifest["world_size"] == 2
    assert {"rank_0.pt", "rank_1.pt", "dcp/.metadata"} <= set(manifest["files"])
    assert sum(name.endswith(".distcp") for name in manifest["files"]) == 2  # every rank wrote
    for rank, out in enumerate(results):
        assert "restore(objects)" in out["load_error"]
        step, local, bias, tag, r = out["step2"]
        assert step == 2 and tag == "two" and r == rank and torch.equal(bias, torch.ones(3) * 2)
        assert torch.equal(local, (full * 2)[8 * rank : 8 * rank + 8])  # this rank's shard
        step, local, tag = out["fallback"]
        assert step == 1 and tag == "one" and torch.equal(local, full[8 * rank : 8 * rank + 8])
    corrupt = [
        e
        for e in map(json.loads, event_log.read_text().splitlines())
        if e["kind"] == "checkpoint_corrupt"
    ]
    assert corrupt and all(e["path"].endswith("step_2") for e in corrupt)
    assert "checksum mismatch" in corrupt[0]["reason"]
