"""The training state beyond model and optimizer: RNG streams, data position, restore()."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from steadfast import (
    CheckpointManager,
    ConfigError,
    DataPosition,
    NaNDetector,
    ResumableSampler,
    RNGState,
    Stateful,
)


def _draw() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_rng_state_restores_every_stream():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draw()
    saved = RNGState().state_dict()
    expected = _draw()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)  # streams move on
    RNGState().load_state_dict(saved)
    got = _draw()
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_restore_loads_objects_and_rng(tmp_path: Path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    nan = NaNDetector()
    nan.check_loss(float("inf"), 7)
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(3, {"model": model, "nan": nan, "epoch": 1})
    after_save = torch.rand(2)
    fresh, fresh_nan = torch.nn.Linear(4, 2), NaNDetector()
    torch.rand(100)  # the stream moves on
    step, state = mgr.restore({"model": fresh, "nan": fresh_nan})
    assert step == 3 and state["epoch"] == 1
    assert torch.equal(fresh.weight, model.weight) and fresh_nan.state_dict() == nan.state_dict()
    assert torch.equal(torch.rand(2), after_save)  # RNG restored to the moment of save


def test_rank_state_goes_to_its_own_file(tmp_path: Path):
    mgr = CheckpointManager(tmp_path / "ckpt", rng=False)
    mgr.save(1, {"w": torch.ones(2)}, rank_state={"data": {"epoch": 2, "batches": 5}})
    files = sorted(p.name for p in (tmp_path / "ckpt" / "step_1").iterdir())
    assert files == ["manifest.json", "rank_0.pt", "state.pt"]
    _, state = mgr.load()
    assert state["data"] == {"epoch": 2, "batches": 5} and "rng" not in state


def test_reserved_and_colliding_keys_are_config_errors(tmp_path: Path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="'rng' is reserved"):
        mgr.save(1, {"rng": 1})
    with pytest.raises(ConfigError, match=r"keys in both state and rank_state: \['x'\]"):
        mgr.save(1, {"x": 1}, rank_state={"x": 2})
    with pytest.raises(ConfigError, match="keys must be strings"):
        mgr.save(1, {3: 1})
    assert not list((tmp_path / "ckpt").glob(".sf-*"))


def test_stateful_protocol_accepts_user_objects():
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["n"]

    assert isinstance(Counter(), Stateful) and isinstance(DataPosition([]), Stateful)
    assert not isinstance(object(), Stateful)


def _epoch(pos: DataPosition, stop_after: int | None = None) -> list[list[int]]:
    out = []
    for batch in pos:
        out.append(batch.tolist())
        if stop_after is not None and len(out) == stop_after:
            break
    return out


@pytest.mark.parametrize("resumable", [True, False])
def test_data_position_resumes_mid_epoch(resumable: bool):
    data = torch.arange(20)

    def loader() -> DataLoader:
        if resumable:
            return DataLoader(data, batch_size=3, sampler=ResumableSampler(20, seed=4))
        g = torch.Generator().manual_seed(4)
        return DataLoader(data, batch_size=3, shuffle=True, generator=g)

    full = DataPosition(loader())
    full.set_epoch(1)
    uninterrupted = _epoch(full)
    first = DataPosition(loader())
    first.set_epoch(1)
    head = _epoch(first, stop_after=4)
    saved = first.state_dict()
    assert saved == {"epoch": 1, "batches": 4, "samples": 12 if resumable else None}
    resumed = DataPosition(loader())
    resumed.load_state_dict(saved)
    assert head + _epoch(resumed) == uninterrupted
    done = {"epoch": 2, "batches": 0, "samples": 0 if resumable else None}
    assert resumed.state_dict() == done  # the epoch completed


def test_data_position_with_lookahead_counts_only_trained_batches():
    """A consumer that draws one batch ahead (Lightning's fit loop) and saves in its
    batch hook: the position is the batches trained, so the resumed epoch goes on with
    the batch that was drawn but never trained, and none is skipped or trained twice;
    after the last batch the look-ahead met the end, so the position is the next epoch."""
    data = torch.arange(20)

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=3, sampler=ResumableSampler(20, seed=4))

    uninterrupted = _epoch(DataPosition(loader()))
    pos = DataPosition(loader(), lookahead=1)
    it = iter(pos)
    ahead = next(it)
    trained = []
    for _ in range(4):  # train the batch in hand, draw the next one, then save
        trained.append(ahead.tolist())
        ahead = next(it)
    saved = pos.state_dict()
    assert saved == {"epoch": 0, "batches": 4, "samples": 12}
    resumed = DataPosition(loader(), lookahead=1)
    resumed.load_state_dict(saved)
    rest = _epoch(resumed)
    assert trained + rest == uninterrupted
    assert resumed.state_dict() == {"epoch": 1, "batches": 0, "samples": 0}
    with pytest.raises(ConfigError, match=r"DataPosition\.lookahead"):
        DataPosition([], lookahead=-1)


def test_data_position_after_a_complete_epoch_means_the_next_one():
    sampler = ResumableSampler(8, seed=1)
    pos = DataPosition(DataLoader(torch.arange(8), batch_size=2, sampler=sampler))
    first = _epoch(pos)
    saved = pos.state_dict()
    assert saved == {"epoch": 1, "batches": 0, "samples": 0}
    second = _epoch(pos)
    resumed = DataPosition(
        DataLoader(torch.arange(8), batch_size=2, sampler=ResumableSampler(8, seed=1))
    )
    resumed.load_state_dict(saved)
    assert _epoch(resumed) == second != first  # epoch 1 from its start, not epoch 0 again


def test_resumable_sampler_shares_out_an_epoch():
    shares = [list(ResumableSampler(10, num_replicas=3, rank=r, seed=1)) for r in range(3)]
    assert all(len(s) == 4 for s in shares)
    assert set().union(*shares) == set(range(10))  # padded, so every index is seen
    s = ResumableSampler(10, num_replicas=3, rank=0, seed=1)
    s.set_epoch(1)
    assert list(s) != shares[0]  # a new permutation per epoch
    with pytest.raises(ConfigError, match="rank must be < num_replicas"):
        ResumableSampler(10, num_replicas=2, rank=2)


def test_async_staging_reuses_buffers_and_keeps_tied_tensors(tmp_path: Path):
    w = torch.randn(100)
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=True, rng=False)
    mgr.save(1, {"a": w, "tied": w})
    buffers = list(mgr._stager._buffers)
    assert len(buffers) == 1  # the tied tensor is staged once
    before = w.clone()
    w.add_(1)  # training goes on while the snapshot is written
    mgr.save(2, {"a": w, "tied": w})
    assert [b is buf for b, buf in zip(mgr._stager._buffers, buffers, strict=True)] == [True]
    mgr.wait()
    _, one = mgr.load(tmp_path / "ckpt" / "step_1")
    _, two = mgr.load()
    assert torch.equal(one["a"], before) and torch.equal(two["a"], w)
    assert two["a"].data_ptr() == two["tied"].data_ptr()  # tied weights stay one tensor
    mgr.close()


def test_stateful_dataloader_resumes_through_rank_state(tmp_path: Path):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = list(range(12))
    loader = sdl.StatefulDataLoader(data, batch_size=2, shuffle=False)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, {}, rank_state={"data": loader})
    resumed = sdl.StatefulDataLoader(data, batch_size=2, shuffle=False)
    mgr.restore({"data": resumed})
    assert head + [b.tolist() for b in resumed] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
    ]


def test_resume_from_a_position_all_ranks_reached_is_skip():
    """Same number of ranks: the global position resumes exactly where skip does."""
    for rank in range(3):
        skipped = ResumableSampler(30, num_replicas=3, rank=rank, seed=2)
        skipped.skip(4)
        resumed = ResumableSampler(30, num_replicas=3, rank=rank, seed=2)
        resumed.resume_from(12)
        assert list(resumed) == list(skipped)
        assert list(resumed) == list(ResumableSampler(30, num_replicas=3, rank=rank, seed=2))


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 1), (3, 2)])
def test_elastic_resume_sees_each_sample_once(before: int, after: int):
    """An epoch of 48 samples, batches of 2: ``before`` ranks take 3 steps and save the
    (global) position; ``after`` ranks resume from it. Every sample is taken exactly
    once across the change."""
    n, batch = 48, 2

    def loaders(world: int) -> list[DataPosition]:
        return [
            DataPosition(
                DataLoader(
                    torch.arange(n),
                    batch_size=batch,
                    sampler=ResumableSampler(n, num_replicas=world, rank=r, seed=9),
                )
            )
            for r in range(world)
        ]

    seen: list[int] = []
    first = loaders(before)
    for pos in first:
        for step in _epoch(pos, stop_after=3):
            seen.extend(step)
    states = [pos.state_dict() for pos in first]
    assert all(s == states[0] for s in states)  # the same on every rank: replicated state
    assert states[0]["samples"] == 3 * batch * before
    for pos in loaders(after):
        pos.load_state_dict(states[0])
        for step in _epoch(pos):
            seen.extend(step)
        assert pos.state_dict()["epoch"] == 1
    assert sorted(seen) == list(range(n))


def test_elastic_resume_mid_run_position_keeps_counting():
    """After a resume with other ranks, the saved position goes on from the global one."""
    pos = DataPosition(
        DataLoader(torch.arange(40), batch_size=2, sampler=ResumableSampler(40, num_replicas=2))
    )
    pos.load_state_dict({"epoch": 0, "batches": 2, "samples": 16})  # 4 ranks x 2 steps
    it = iter(pos)
    next(it)
    next(it)
    assert pos.state_dict() == {"epoch": 0, "batches": 6, "samples": 24}
