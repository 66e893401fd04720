"""The checkpoint tiers with the state on a GPU, as users train: a model and its Adam
state on CUDA (DDP's shape: every tensor whole), and the same under FSDP2 (``fully_shard``
on a one-GPU mesh, DTensor parameters and optimizer state, NCCL), in a real process group
(``cpu:gloo,cuda:nccl``: the manager's own collectives run on gloo, the model's on NCCL).

Each test trains with dropout (the CUDA generator matters), "crashes" after step 3 (the
objects are thrown away and built again from another seed), restores, trains on, and
ends bit for bit where the uninterrupted run ends. Skipped without a CUDA device (CI has
none); run where one is lent:

    python -m pytest tests/gpu -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import read_events

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS, CRASH = 6, 3


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STEADFAST_MEMORY_DIR", str(tmp_path / "mem"))
    monkeypatch.setenv("STEADFAST_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", tmp_path.name)
    (tmp_path / "mem").mkdir()
    return tmp_path


def _build(seed: int, sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(512, 8)
    ).cuda()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        fully_shard(net)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def _step(net: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One step on this step's batch (a function of the step: the data position)."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    x = torch.randn(64, 256, device="cuda", generator=gen)
    loss = net(x).square().mean()  # dropout draws from the CUDA generator
    opt.zero_grad()
    loss.backward()
    opt.step()


def _params(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in net.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.detach().cpu().clone()
    return out


def _objects(net: torch.nn.Module, opt: torch.optim.Optimizer, sharded: bool) -> dict[str, Any]:
    if sharded:
        from steadfast.checkpoint import ShardedTrainState

        return {"train": ShardedTrainState(net, opt)}
    return {"model": net, "optim": opt}


def _run(workdir: Path, sharded: bool, tier: str) -> None:
    from steadfast import CheckpointManager

    net, opt = _build(0, sharded)
    torch.manual_seed(7)  # the same dropout stream in both runs
    for step in range(1, STEPS + 1):
        _step(net, opt, step)
    expected = _params(net)

    net, opt = _build(0, sharded)
    torch.manual_seed(7)
    mgr = CheckpointManager(workdir / "ck", memory_every=1, keep_last_n=2)
    for step in range(1, CRASH + 1):
        _step(net, opt, step)
        if tier == "memory":
            mgr.snapshot(step, _objects(net, opt, sharded))
        else:
            mgr.save(step, _objects(net, opt, sharded))
    mgr.close()
    torch.manual_seed(99)  # the crash: what the generator drew since is lost
    del net, opt

    net, opt = _build(123, sharded)  # other weights until the restore
    where = [p.data_ptr() for p in net.parameters()]
    again = CheckpointManager(workdir / "ck", memory_every=1)
    restored = again.restore(_objects(net, opt, sharded))
    # every restore is proven by replay (issue 38): where every step went to disk as a
    # whole state, the restore takes the step before the newest and the loop's save of
    # the newest is compared with it; sharded state and the memory tier's newest restore
    # the newest (no losses logged here: unverified)
    proven = tier == "disk" and not sharded
    first = CRASH - 1 if proven else CRASH
    assert restored is not None and restored[0] == first
    assert all(p.is_cuda for p in net.parameters())
    assert [p.data_ptr() for p in net.parameters()] == where  # filled in place
    state = opt.state_dict()["state"]
    assert state and all(v.is_cuda for s in state.values() for v in s.values() if v.dim())
    for step in range(first + 1, STEPS + 1):
        _step(net, opt, step)
        if tier == "memory":
            again.snapshot(step, _objects(net, opt, sharded))
        else:
            again.save(step, _objects(net, opt, sharded))
    again.close()
    got = _params(net)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    evs = read_events(workdir / "events.jsonl")
    (loaded,) = [e for e in evs if e["kind"] == "checkpoint_loaded"]
    assert loaded["tier"] == tier and loaded["step"] == first, loaded
    verdicts = [e for e in evs if e["kind"].startswith("restore_")]
    assert [e["kind"] for e in verdicts] == [
        "restore_verified" if proven else "restore_unverified"
    ], verdicts


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "fsdp2"])
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_cuda_state_resumes_bit_exact(group: None, workdir: Path, sharded: bool, tier: str) -> None:
    _run(workdir, sharded, tier)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_the_uploader_copies_what_copy_would(dtype: torch.dtype) -> None:
    """Through the pinned chunks (large, dense, pageable) or a plain ``copy_`` (small, a
    strided target, a pinned source): the same values in every case."""
    from steadfast.checkpoint.upload import CHUNK, Uploader

    torch.manual_seed(0)
    sizes = [7, (1 << 20) + 3, 2 * CHUNK + 4097]  # one element over 2 chunks, and more
    cases = [(torch.randn(n).mul(1000).to(dtype), torch.empty(n, dtype=dtype, device="cuda"))
             for n in sizes]  # fmt: skip
    wide = torch.empty(512, 4096, dtype=dtype, device="cuda")
    cases.append((torch.randn(4096, 512).mul(1000).to(dtype), wide.t()))  # strided target
    pinned = torch.randn(1 << 20).to(dtype).pin_memory()
    cases.append((pinned, torch.empty(1 << 20, dtype=dtype, device="cuda")))  # pinned source
    with Uploader() as up:
        for src, dst in cases:
            up.copy(dst, src)
    for src, dst in cases:
        assert torch.equal(dst.cpu(), src)


def test_a_snapshot_stages_without_waiting_for_the_device() -> None:
    """The host does not wait for the device at a snapshot: staging returns while a
    long kernel queued before it still runs, and the staged buffers, once settled, hold
    the tensors as they were at the snapshot, not the update queued right after it."""
    from steadfast.checkpoint.staging import Stager

    torch.manual_seed(0)
    weight = torch.randn(1 << 22, device="cuda")
    step = torch.randn(1 << 22, device="cuda")
    stager = Stager()
    for _ in range(2):  # the second stage reuses the first one's pinned buffers
        expected = weight.clone()  # queued on the stream, before the snapshot
        torch.cuda._sleep(1_000_000_000)  # the step's queued work: ~0.5 s of cycles
        queued = torch.cuda.Event()
        queued.record()
        staged = stager.stage({"weight": weight})
        assert not queued.query(), "staging waited for the device"
        weight.add_(step)  # the next update, queued behind the copy
        stager.settle()
        assert staged["weight"].is_pinned()
        assert torch.equal(staged["weight"], expected.cpu())
    stager.clear()
