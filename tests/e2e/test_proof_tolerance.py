"""A restore proven within the rounding of a reduction that sums in another order.

Four ranks of plain DDP (``find_unused_parameters`` left False, as most scripts do):
after a restart DDP's first backward uses the buckets it built at construction, the run
that never stopped had rebuilt them in gradient-ready order, so the state a re-done step
reaches differs from the snapshot of that step in its last bits. That is rounding, not
a lost state: the restore is proven (``restore_verified``, ``exact: false``, the
difference) and the run goes on. Before the tolerance the proof called it a mismatch,
every checkpoint was excluded in turn, and the job ended with exit 17 (``steadfast
demo --nproc 4`` did).
With ``find_unused_parameters=True`` the same restart is bit for bit; with a tolerance
of 0 the old verdict comes back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfharness import assert_none_left, read_events

SCRIPT = Path(__file__).with_name("ddp_loop.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _launch(tmp_path: Path, *script_args: str, restarts: int = 2) -> tuple[int, list[dict]]:
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
        "--nproc-per-node=4", f"--max-restarts={restarts}", "--run-dir=run",
        str(SCRIPT), "15", *script_args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("STEADFAST_EVENTS", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert_none_left(str(tmp_path))
    return proc.returncode, read_events(tmp_path / "run" / "events.jsonl")


def test_plain_ddp_with_four_ranks_is_proven_within_rounding(tmp_path: Path) -> None:
    code, evs = _launch(tmp_path)
    assert code == 0
    assert [e for e in evs if e["kind"] == "restore_mismatch"] == []
    [proof] = [e for e in evs if e["kind"] == "restore_verified"]
    assert proof["exact"] is False and 0 < proof["difference"] <= 1e-5, proof
    # a snapshot every step: the one before the newest restored, one step re-done and
    # its state compared with the newest snapshot's
    assert proof["ranks"] == 4 and proof["route"] in ("state", "both"), proof
    assert proof["proof_steps"] == 1 and proof["tier"] == "memory", proof


def test_find_unused_parameters_makes_the_same_restart_bit_exact(tmp_path: Path) -> None:
    code, evs = _launch(tmp_path, "exact")
    assert code == 0
    [proof] = [e for e in evs if e["kind"] == "restore_verified"]
    assert proof["exact"] is True and proof["difference"] is None, proof


def test_a_tolerance_of_zero_takes_only_bit_for_bit(tmp_path: Path) -> None:
    """Every restore then fails its proof, each tier's checkpoints are excluded in turn,
    and with none left the workers end with exit 17 (the launcher does not restart)."""
    code, evs = _launch(tmp_path, "--tolerance", "0", restarts=8)
    assert code == 17
    mismatches = [e for e in evs if e["kind"] == "restore_mismatch"]
    assert mismatches and all(e["cause"] == "replay" for e in mismatches)
