"""The checkpoint fence in a real 2-rank gloo group: a rank whose node is fenced makes
the whole save fail on every rank at once (no rank waits in a collective for it), and
nothing is written."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from sfharness import refusing_fence, run_ranks


def _save(rank: int, world: int, workdir: Path, ckpt: str) -> str:
    from steadfast import CheckpointFenced, CheckpointManager
    from steadfast.checkpoint import CheckpointError
    from steadfast.fence import FENCE_ENV

    with contextlib.ExitStack() as stack:
        if rank == 1:  # this rank's launcher says its node was left behind
            answer = "fenced: the job formed a newer round without this node"
            os.environ[FENCE_ENV] = stack.enter_context(refusing_fence(answer))
        mgr = CheckpointManager(ckpt)
        try:
            mgr.save(4, {"model": torch.nn.Linear(2, 2)})
        except CheckpointFenced as exc:
            return f"fenced: {exc}"
        except CheckpointError as exc:
            return f"failed: {exc}"
        finally:
            mgr.close()
    return "saved"


def test_one_fenced_rank_fails_the_save_on_every_rank_and_nothing_is_written(tmp_path):
    ckpt = tmp_path / "ck"
    fenced, other = run_ranks(_save, tmp_path / "w", args=(str(ckpt),), timeout=60)[::-1]
    assert fenced.startswith("fenced: ") and "newer round" in fenced
    assert other.startswith("failed: ") and "fenced" in other
    assert not list(ckpt.rglob("*")), "a checkpoint was written"
