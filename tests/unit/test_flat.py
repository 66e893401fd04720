"""The memory tier's flat snapshot file: what goes in comes back, tied tensors stay tied,
what the layout does not keep is written whole, and a damaged file is named."""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from steadfast.checkpoint.files import crc32_file
from steadfast.checkpoint.flat import MAGIC, SLOT, load_flat, save_flat
from steadfast.checkpoint.layout import CheckpointError


def _state() -> dict:
    shared = torch.randn(3, 4)
    return {
        "model": {
            "w": torch.randn(5, 7),
            "tied": shared,
            "also_tied": shared,
            "half": torch.randn(9).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "steps": torch.tensor(12, dtype=torch.int64),  # 0-d
            "empty": torch.empty(0, 3),
            "z": torch.randn(2, dtype=torch.complex64),
        },
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "text": ("a", 1, None),
        "kinds": [torch.float16, torch.device("cpu"), torch.Size([2, 3])],
    }


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_a_state_comes_back_from_the_file_and_from_its_bytes(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "rank.pt"
    meta = save_flat(path, state)
    raw = path.read_bytes()
    assert raw[:8] == MAGIC
    assert meta == {"bytes": len(raw), "crc32": crc32_file(path)}
    for loaded in (load_flat(path, "rank.pt"), load_flat(memoryview(raw), "rank.pt")):
        _same(state, loaded)
        model = loaded["model"]
        assert model["tied"] is model["also_tied"]  # one tensor, as torch.save keeps it
        torch.set_rng_state(loaded["rng"]["torch"])  # reads the tensor's storage from 0
        random.setstate(loaded["rng"]["python"])


def test_tensors_read_in_place_are_copy_on_write(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    save_flat(path, {"w": torch.zeros(1000)})
    before = path.read_bytes()
    loaded = load_flat(path, "state.pt")
    loaded["w"] += 1
    assert path.read_bytes() == before
    assert loaded["w"].storage_offset() == 0


@pytest.mark.parametrize(
    "odd",
    [
        torch.randn(4, 6).t(),
        torch.randn(3, dtype=torch.complex64).conj(),
        (SLOT, 0),
        OrderedDict(epoch=2, inner=torch.arange(4)),
    ],
    ids=["non-contiguous", "conjugate view", "a slot-shaped tuple", "another mapping"],
)
def test_what_the_layout_does_not_keep_is_written_whole(tmp_path: Path, odd: object) -> None:
    path = tmp_path / "rank.pt"
    state = {"x": torch.randn(2), "odd": odd}
    save_flat(path, state)
    assert path.read_bytes()[:8] != MAGIC  # an ordinary torch.save file
    _same(state, load_flat(path, "rank.pt"))


@pytest.mark.parametrize("keep", [-100, 40], ids=["in the tensors", "in the header"])
def test_a_truncated_file_is_named(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "state.pt"
    save_flat(path, {"w": torch.randn(4096)})
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match=r"state\.pt.*damaged"):
        load_flat(path, str(path))
