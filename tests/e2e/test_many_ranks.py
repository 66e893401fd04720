"""Four ranks on a node, with DDP and with FSDP2 (``fully_shard``): a rank killed, or the
job preempted (SIGTERM: every rank saves the same step and the launcher exits; the job
started again resumes), ends bit for bit where the fault-free run ends, from the disk
tier and from the memory tier (replicated state kept once per node, shards per rank).

DDP is built with ``find_unused_parameters=True`` (ft_train.py): DDP then never rebuilds
its buckets, so the first step after a restart reduces in the same layout as every step
of the run that never stopped; with more than two gloo ranks another layout sums each
element in another order (docs/architecture.md, "bit for bit with many ranks").
FSDP2's reduce-scatter layout is fixed by the module and the world size."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import assert_bit_exact, launch_run, read_events

HERE = Path(__file__).parent
STEPS = 10


def launch(workdir: Path, mode: str, *script_args: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(
        workdir, "--nproc-per-node=4", "--monitor-interval=0.1", "--max-restarts=3",
        str(HERE / "ft_train.py"), "--ckpt", str(workdir / "ck"),
        "--out", str(workdir / "out.pt"), "--steps", str(STEPS), "--ckpt-every", "4",
        "--step-sleep", "0.05", *(["--fsdp"] if mode == "fsdp" else []), *script_args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    made = {}
    for mode in ("ddp", "fsdp"):
        root = tmp_path_factory.mktemp(f"many_{mode}")
        code, _ = launch(root, mode)
        assert code == 0
        made[mode] = torch.load(root / "out.pt")
    return made


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory"])
def test_a_killed_rank_of_four_resumes_bit_exact(tmp_path, references, mode, memory):
    extra = ["--memory-every", "1"] if memory else []
    # SIGKILL late in step 6, once the snapshot of the steps before is written
    code, evs = launch(tmp_path, mode, "--kill-every", "6", "--fault-rank", "2", *extra)
    assert code == 0
    failed = [e for e in evs if e["kind"] == "rank_failed"]
    assert [e["rank"] for e in failed] == [2] and failed[0]["cause"] == "signal SIGKILL"
    loads = [e for e in evs if e["kind"] == "checkpoint_loaded"]
    assert sorted(e["rank"] for e in loads) == [0, 1, 2, 3]
    # from memory: the step the killed rank was in (6); from disk: the last save (4)
    assert {(e["step"], e["tier"]) for e in loads} == ({(6, "memory")} if memory else {(4, "disk")})
    assert_bit_exact(tmp_path / "out.pt", references[mode])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_preempted_job_of_four_ranks_resumes_bit_exact(tmp_path, references, mode):
    """SIGTERM to the launcher mid-run: every rank saves the same step and the job ends;
    started again, it resumes from that checkpoint."""
    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--events", str(events),
           "--nproc-per-node=4", "--monitor-interval=0.1", str(HERE / "ft_train.py"),
           "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "out.pt"),
           "--steps", str(STEPS), "--ckpt-every", "100", "--step-sleep", "0.3", "--graceful",
           *(["--fsdp"] if mode == "fsdp" else [])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(e["kind"] == "step_done" and e["step"] >= 3 for e in read_events(events)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    saved = [e for e in read_events(events) if e["kind"] == "checkpoint_saved"]
    assert saved and len({e["step"] for e in saved}) == 1 and saved[0]["step"] < STEPS
    code, evs = launch(tmp_path, mode, "--graceful")
    assert code == 0
    loads = [e for e in evs if e["kind"] == "checkpoint_loaded"]
    assert {e["step"] for e in loads} == {saved[0]["step"]} and len(loads) == 4
    assert_bit_exact(tmp_path / "out.pt", references[mode])
