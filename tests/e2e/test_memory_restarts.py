"""The memory tier end to end: ``steadfast launch`` with ``CheckpointManager(memory_every=1)``
(``tests/e2e/ft_train.py --memory-every 1``), real SIGKILLs, real shared memory.

- a rank killed every few steps: each in-job restart resumes from the step it was in,
  read from memory, none re-done; the final parameters equal the fault-free run's;
- the killed rank's snapshots damaged before it dies: the flipped bytes are caught
  (``checkpoint_corrupt``, cause ``memory``) and the disk checkpoint is used, bit-exact;
- a process snapshotting in a loop, SIGKILLed at random moments: every snapshot visible
  under a ``step_N`` name is whole and verifies.
And the launcher removes its snapshots when the job ends.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import assert_bit_exact, fork_when_ready, launch_run, suite_shm
from steadfast.checkpoint import verify

HERE = Path(__file__).parent
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("no_worker_outlives_its_launcher"),
]


def launch(workdir: Path, *script_args: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(
        workdir, "--nproc-per-node=2", "--monitor-interval=0.1", "--max-restarts=5",
        str(HERE / "ft_train.py"), "--ckpt", str(workdir / "ck"),
        "--out", str(workdir / "out.pt"), "--steps", "12", "--ckpt-every", "4",
        "--step-sleep", "0.05", *script_args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("memory_reference")
    code, _ = launch(root)
    assert code == 0
    return torch.load(root / "out.pt")


def memory_dirs() -> set[str]:
    return suite_shm("steadfast-mem-*")


def test_a_rank_killed_every_three_steps_resumes_from_memory_none_re_done(tmp_path, reference):
    before = memory_dirs()
    code, evs = launch(tmp_path, "--memory-every", "1", "--kill-every", "3")
    assert code == 0
    killed = [e for e in evs if e["kind"] == "rank_failed" and e.get("cause") == "signal SIGKILL"]
    assert len(killed) == 3  # steps 3, 6 and 9
    loads = [e for e in evs if e["kind"] == "checkpoint_loaded"]
    # each restart read, on both ranks, the step the killed rank was in: none re-done
    assert sorted((e["step"], e["rank"]) for e in loads) == [
        (s, r) for s in (3, 6, 9) for r in (0, 1)
    ]
    assert {e["tier"] for e in loads} == {"memory"}
    assert_bit_exact(tmp_path / "out.pt", reference)
    assert memory_dirs() == before  # the launcher removed its snapshots


def test_damaged_snapshots_are_caught_and_the_disk_checkpoint_used(tmp_path, reference):
    code, evs = launch(tmp_path, "--memory-every", "1", "--kill-every", "6", "--corrupt-memory")
    assert code == 0
    corrupt = [e for e in evs if e["kind"] == "checkpoint_corrupt"]
    assert corrupt and {e["cause"] for e in corrupt} == {"memory"}
    assert all(e["rank"] == 1 and "checksum" in e["reason"] for e in corrupt)
    loads = [e for e in evs if e["kind"] == "checkpoint_loaded"]
    assert {(e["step"], e["tier"]) for e in loads} == {(4, "disk")}
    assert_bit_exact(tmp_path / "out.pt", reference)


def _start_snapshotter(mem: Path, ckpt: Path) -> int:
    """A process that snapshots in a loop; its pid once it snapshots."""

    def loop(ready) -> None:
        os.environ["STEADFAST_MEMORY_DIR"] = str(mem)
        os.environ["STEADFAST_EVENTS"] = "off"
        from steadfast import CheckpointManager

        mgr = CheckpointManager(ckpt, memory_every=1)
        loaded = mgr.load()
        step = loaded[0] if loaded else 0
        ready()
        while True:
            step += 1
            mgr.snapshot(step, {"w": torch.full((2_000_000,), float(step)), "step": step})

    return fork_when_ready(loop)


def test_sigkill_during_snapshots_never_leaves_a_partial_one_visible(tmp_path):
    from steadfast import CheckpointManager

    rng = random.Random(4321)
    mem, ckpt = tmp_path / "mem", tmp_path / "ck"
    mem.mkdir()
    os.environ["STEADFAST_MEMORY_DIR"] = str(mem)
    last = 0
    try:
        for kill in range(12):
            pid = _start_snapshotter(mem, ckpt)
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            for snapshot in mem.glob("*/own/rank_0/step_*"):
                assert verify(snapshot) == [], f"after kill {kill}: {snapshot} is partial"
            loaded = CheckpointManager(ckpt, memory_every=1).load()
            # what the kill left half-written was cleared when the tier started
            assert not list(mem.glob("*/own/rank_0/.sf-*")), f"after kill {kill}"
            if loaded is None:
                continue
            step, state = loaded
            assert state["step"] == step and float(state["w"][0]) == float(step)
            assert step >= last
            last = step
    finally:
        os.environ.pop("STEADFAST_MEMORY_DIR", None)
    assert last > 0
