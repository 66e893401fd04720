"""The memory tier in one process: snapshots in a real memory directory, restored in
tiers against the disk, the budget checked on a real (small) tmpfs, and the CRC-32 of
one buffer on several threads equal to zlib's."""

from __future__ import annotations

import json
import os
import subprocess
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sfharness import read_events
from steadfast import CheckpointManager, ConfigError
from steadfast.checkpoint.files import crc32_mapped, crc32_parallel

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    mem = tmp_path / "mem"
    mem.mkdir()
    monkeypatch.setenv("STEADFAST_MEMORY_DIR", str(mem))
    monkeypatch.setenv("STEADFAST_EVENTS", str(tmp_path / "events.jsonl"))
    return mem


def _loaded(tmp_path: Path) -> list[tuple[int, str]]:
    evs = read_events(tmp_path / "events.jsonl")
    return [(e["step"], e["tier"]) for e in evs if e["kind"] == "checkpoint_loaded"]


def test_the_newest_of_memory_and_disk_is_restored(tmp_path, memory):
    net = torch.nn.Linear(3, 2)
    with CheckpointManager(tmp_path / "ck", memory_every=2) as mgr:
        for step in range(1, 8):
            with torch.no_grad():
                net.weight.add_(1.0)
            mgr.snapshot(step, {"model": net})  # odd steps: not a snapshot step
            if step == 3:
                mgr.save(step, {"model": net})
        mgr.save(7, {"model": net})  # the disk is newer than the memory tier (6)
    with CheckpointManager(tmp_path / "ck", memory_every=2) as mgr:
        assert mgr.load()[0] == 7
    assert _loaded(tmp_path) == [(7, "disk")]
    kept = sorted(p.name for p in memory.glob("*/own/rank_0/*"))
    assert kept == ["step_2", "step_4", "step_6"]  # the three newest, none newer than 7
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        mgr.snapshot(8, {"model": net})
    fresh = torch.nn.Linear(3, 2)
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        assert mgr.restore({"model": fresh})[0] == 8
    assert _loaded(tmp_path)[-1] == (8, "memory")
    assert torch.equal(fresh.weight, net.weight)


def test_a_snapshot_still_being_written_when_the_loop_restarts_in_process_is_restored(
    tmp_path, memory, monkeypatch
):
    """An in-process restart: the loop raised right after its snapshot of step 2, whose
    write was still on the tier's thread (slow here on purpose: a busy machine), and its
    manager was never closed. The next manager in the process waits for that write and
    restores step 2, the last step done, not step 1."""
    from steadfast.checkpoint.memory import MemoryTier

    real = MemoryTier._write

    def slow(self, *args, **kwargs):
        time.sleep(0.5)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MemoryTier, "_write", slow)
    net = torch.nn.Linear(3, 2)
    abandoned = CheckpointManager(tmp_path / "ck", memory_every=1)
    for step in (1, 2):
        with torch.no_grad():
            net.weight.add_(1.0)
        abandoned.snapshot(step, {"model": net})
    fresh = torch.nn.Linear(3, 2)
    with CheckpointManager(tmp_path / "ck", memory_every=1) as again:
        assert again.restore({"model": fresh})[0] == 2
    assert _loaded(tmp_path) == [(2, "memory")]
    assert torch.equal(fresh.weight, net.weight)
    abandoned.close()


def test_snapshots_share_one_writer_thread_and_an_abandoned_tiers_ends_with_the_next_tier(
    tmp_path, memory
):
    """No thread is started per snapshot (its start was most of a snapshot's stall): a
    tier's writes run on one thread. A tier abandoned unclosed (an in-process restart's)
    does not keep it: the next tier of its folder retires it."""
    import threading

    def writers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "steadfast-memory-writer"]

    net = torch.nn.Linear(3, 2)
    abandoned = CheckpointManager(tmp_path / "ck", memory_every=1)
    seen = set()
    for step in (1, 2, 3):
        abandoned.snapshot(step, {"model": net})
        seen.update(writers())
    assert len(seen) == 1
    (thread,) = seen
    with CheckpointManager(tmp_path / "ck", memory_every=1) as again:
        thread.join(10)  # retired by the new tier: its last write done, it ends
        assert not thread.is_alive()
        again.snapshot(4, {"model": net})
        assert len(writers()) == 1
    assert writers() == []
    abandoned.close()


def test_a_snapshot_of_another_job_is_never_restored(tmp_path, memory, monkeypatch):
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        mgr.snapshot(5, {"w": torch.ones(2)})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
    with CheckpointManager(tmp_path / "ck", memory_every=1) as mgr:
        assert mgr.load() is None


def test_snapshot_needs_the_memory_tier(tmp_path):
    with pytest.raises(ConfigError, match="memory_every > 0"):
        CheckpointManager(tmp_path / "ck").snapshot(1, {"w": torch.ones(1)})
    with pytest.raises(ConfigError, match="memory_every"):
        CheckpointManager(tmp_path / "ck", memory_every=-1)


def test_a_memory_directory_too_small_is_one_error_before_the_first_write(tmp_path, monkeypatch):
    """A real 8 MiB tmpfs: three snapshots of a 4 MiB state do not fit; the first
    snapshot says so, naming the sizes, and writes nothing."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        monkeypatch.setenv("STEADFAST_MEMORY_DIR", str(small))
        mgr = CheckpointManager(tmp_path / "ck", memory_every=1)
        with pytest.raises(ConfigError, match=r"memory_every: .*small \(.* GiB free\) cannot"):
            mgr.snapshot(1, {"w": torch.zeros(1 << 20)})  # 4 MiB
        mgr.close()
        assert not list(small.rglob("*.pt"))
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize("size", [0, 1, (8 << 20) + 3, 40 << 20])
def test_the_crc_of_a_buffer_on_several_threads_is_zlibs(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    with ThreadPoolExecutor(3) as pool:
        for shares in (1, 2, 3, 5):
            assert crc32_parallel(memoryview(data), pool, shares) == zlib.crc32(data)
            assert crc32_mapped(tmp_path / "f", pool, shares) == zlib.crc32(data)


def test_the_crc_is_isals_with_zlibs_values(tmp_path):
    """The checksum of every manifest is computed by ISA-L (the ``isal`` dependency) and
    has zlib's values, continuation included, so manifests written before it verify."""
    from steadfast.checkpoint import files, layout

    assert files.CRC32_BY == "isal"
    data = os.urandom((3 << 20) + 7)
    assert files.crc32(data) == zlib.crc32(data)
    assert files.crc32(data[1000:], files.crc32(data[:1000])) == zlib.crc32(data)
    assert files.crc32(b"") == 0
    # a checkpoint sealed with zlib's checksum (as every steadfast before isal wrote it)
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "state.pt").write_bytes(data)
    manifest = {
        "format": layout.FORMAT,
        "step": 1,
        "world_size": 1,
        "files": {"state.pt": {"bytes": len(data), "crc32": zlib.crc32(data)}},
    }
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest))
    assert layout.verify(ckpt) == []
    (ckpt / "state.pt").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert layout.verify(ckpt) != []
