"""The harness's own promise: a rank that outlives its bound is named with its stack."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sfharness import Ranks


def _rank_one_never_returns(rank: int, world: int, workdir: Path) -> int:
    if rank == 1:
        _sleeping_past_the_bound()
    return rank


def _sleeping_past_the_bound() -> None:
    while True:
        time.sleep(0.05)


def test_a_rank_past_its_bound_is_named_with_every_threads_stack(tmp_path: Path) -> None:
    ranks = Ranks(_rank_one_never_returns, tmp_path, 2, env={"SFHARNESS_NO_INIT": "1"})
    with pytest.raises(TimeoutError) as err:
        ranks.wait(6)
    text = str(err.value)
    assert "still running after 6s:" in text
    assert "--- rank 1 ---" in text and "_sleeping_past_the_bound" in text, text
