"""CheckpointManager in one process: atomic save, verified load, fallback, retention, async."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from sfharness import read_events
from steadfast import CheckpointError, CheckpointManager, ConfigError, NaNDetector
from steadfast.checkpoint import verify


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _kinds(path: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


def test_round_trip_of_stateful_objects(tmp_path: Path, event_log: Path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    nan = NaNDetector()
    nan.check_loss(float("nan"), 3)
    mgr = CheckpointManager(tmp_path / "ckpt")
    assert mgr.load() is None  # nothing yet: a first run
    mgr.save(5, {"model": model, "optim": opt, "nan": nan, "step": 5, "tag": "x"})
    assert os.readlink(tmp_path / "ckpt" / "latest") == "step_5"  # relative link
    assert verify(tmp_path / "ckpt" / "step_5") == []
    step, state = mgr.load()
    assert step == 5 and state["step"] == 5 and state["tag"] == "x"
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    fresh = torch.optim.AdamW(_model().parameters())
    fresh.load_state_dict(state["optim"])
    assert state["nan"]["nan_steps"] == [3]
    saved = _kinds(event_log, "checkpoint_saved")
    assert saved[0]["step"] == 5 and saved[0]["bytes"] > 0 and saved[0]["seconds"] >= 0
    assert _kinds(event_log, "checkpoint_loaded")[0]["step"] == 5


def _three(tmp_path: Path) -> tuple[CheckpointManager, Path]:
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last_n=0)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((1000,), float(step))})
    return mgr, tmp_path / "ckpt"


def _truncate(d: Path) -> None:
    f = d / "step_3" / "state.pt"
    f.write_bytes(f.read_bytes()[:-100])


def _flip(d: Path) -> None:
    f = d / "step_3" / "state.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _no_manifest(d: Path) -> None:
    (d / "step_3" / "manifest.json").unlink()


def _dangling_latest(d: Path) -> None:
    (d / "latest").unlink()
    os.symlink("step_99", d / "latest")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "manifest says"),
        (_flip, "checksum mismatch"),
        (_no_manifest, "manifest.json: missing"),
        (_dangling_latest, None),
    ],
)
def test_corruption_is_detected_and_falls_back(tmp_path: Path, event_log: Path, damage, reason):
    mgr, d = _three(tmp_path)
    damage(d)
    step, state = mgr.load()
    if reason is None:  # latest points nowhere: the newest valid step_N is used
        assert step == 3
        return
    assert step == 2 and float(state["w"][0]) == 2.0
    corrupt = _kinds(event_log, "checkpoint_corrupt")
    assert len(corrupt) == 1 and corrupt[0]["path"].endswith("step_3")
    assert reason in corrupt[0]["reason"]


def test_no_valid_checkpoint_is_one_error_naming_the_files(tmp_path: Path):
    mgr, d = _three(tmp_path)
    for n in (1, 2, 3):
        (d / f"step_{n}" / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"step_3/state\.pt: 7 bytes") as info:
        mgr.load()
    assert "step_1/state.pt" in str(info.value)


def test_loading_never_runs_arbitrary_pickle(tmp_path: Path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "ckpt" / "step_1"
    evil.mkdir(parents=True)
    script = textwrap.dedent(f"""
        import os, torch, zlib, json
        class Evil:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))
        torch.save({{"x": Evil()}}, "{evil}/state.pt")
        data = open("{evil}/state.pt", "rb").read()
        json.dump({{"format": "steadfast-checkpoint/1", "step": 1, "files": {{"state.pt":
                   {{"bytes": len(data), "crc32": zlib.crc32(data)}}}}}},
                  open("{evil}/manifest.json", "w"))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    with pytest.raises(CheckpointError, match=r"safe loader \(weights_only=True\) refuses"):
        CheckpointManager(tmp_path / "ckpt").load()
    assert not marker.exists()


def test_retention_keeps_the_last_n(tmp_path: Path, event_log: Path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last_n=2)
    for step in range(1, 6):
        mgr.save(step, {"step": step})
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_4", "step_5"]
    assert [e["step"] for e in _kinds(event_log, "checkpoint_deleted")] == [1, 2, 3]
    assert mgr.load()[0] == 5


def test_async_save_snapshots_then_writes(tmp_path: Path, event_log: Path):
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=True)
    w = torch.zeros(100_000)
    mgr.save(1, {"w": w})
    w.add_(1.0)  # training goes on mutating the tensor while the write is in flight
    mgr.wait()
    step, state = mgr.load()
    assert step == 1 and float(state["w"].sum()) == 0.0
    ev = _kinds(event_log, "checkpoint_saved")[0]
    assert ev["blocking_seconds"] <= ev["seconds"]


def test_failed_background_save_is_raised_at_the_next_call(tmp_path: Path):
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=True)
    mgr.save(1, {"ok": torch.ones(3)})
    mgr.save(2, {"bad": lambda: None})  # cannot be pickled: fails in the background
    with pytest.raises(CheckpointError, match="background checkpoint save failed"):
        mgr.save(3, {"ok": torch.ones(3)})
    left = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith((".sf-", ".tmp"))]
    assert left == []
    assert mgr.load()[0] == 1


def test_bad_arguments(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="exists but is not a directory"):
        CheckpointManager(f)
    with pytest.raises(ConfigError, match="keep_last_n"):
        CheckpointManager(tmp_path / "c", keep_last_n=1.5)
    with pytest.raises(ConfigError, match="save step"):
        CheckpointManager(tmp_path / "c").save(-1, {})


def test_leftovers_of_an_interrupted_save_are_removed(tmp_path: Path):
    d = tmp_path / "ckpt"
    (d / ".tmp-step_7-123").mkdir(parents=True)
    (d / ".tmp-step_7-123" / "state.pt").write_bytes(b"partial")
    CheckpointManager(d)
    assert list(d.iterdir()) == []


_DISK_FULL = """
import resource, signal, sys, torch
from steadfast import CheckpointManager, CheckpointError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # get EFBIG instead of being killed
mgr = CheckpointManager(sys.argv[1])
mgr.save(1, {"w": torch.zeros(1000)})
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))   # the "disk" is now full
try:
    mgr.save(2, {"w": torch.zeros(1_000_000)})
except CheckpointError as exc:
    print("ERROR:", exc)
    sys.exit(0)
sys.exit(5)
"""


def test_disk_full_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path: Path):
    d = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(d)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"saving checkpoint step 2 to {d / 'step_2'} failed" in proc.stdout
    assert "file size limit exceeded" in proc.stdout  # said in words, not "unexpected pos"
    assert sorted(p.name for p in d.iterdir() if p.name != "events.jsonl") == ["latest", "step_1"]
    assert CheckpointManager(d).load()[0] == 1


def test_a_checkpoint_hidden_for_replacement_comes_back_after_a_crash(tmp_path: Path):
    """Where the file system cannot swap two folders, saving a step that exists hides
    the old copy, then renames the new one in; a kill in between must not lose the step
    (nor leave a damaged copy visible). Also for copies hidden by earlier versions
    (``.del-step_N-PID``)."""
    d = tmp_path / "ckpt"
    mgr = CheckpointManager(d, keep_last_n=0)
    mgr.save(4, {"w": torch.ones(3)})
    mgr.save(5, {"w": torch.ones(3) * 5})
    os.rename(d / "step_5", d / ".sf-del-step_5-999")  # the moment of the kill
    os.rename(d / "step_4", d / ".del-step_4-999")
    (d / ".del-step_4-999" / "state.pt").write_bytes(b"half deleted")
    step, state = CheckpointManager(d).load()
    assert step == 5 and torch.equal(state["w"], torch.ones(3) * 5)
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_5"]


def test_a_named_checkpoint_is_published_whole_and_leaves_latest_and_retention_alone(
    tmp_path: Path,
):
    """A framework's own names (Lightning's ``last.ckpt``): the same manifest and
    atomic publish, a new save of the name replaces the old one whole, ``latest`` stays
    on the last step_N, and keep_last_n never deletes a named checkpoint."""
    d = tmp_path / "ckpt"
    mgr = CheckpointManager(d, keep_last_n=1)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.save(2, {"w": torch.ones(2) * 2}, name="last.ckpt")
    mgr.save(3, {"w": torch.ones(2) * 3}, name="last.ckpt")
    mgr.save(3, {"w": torch.ones(2) * 3}, name="epoch=0-step=3.ckpt")
    mgr.close()
    assert sorted(p.name for p in d.iterdir() if p.name != "events.jsonl") == [
        "epoch=0-step=3.ckpt", "last.ckpt", "latest", "step_1",
    ]  # fmt: skip
    assert os.readlink(d / "latest") == "step_1"
    assert verify(d / "last.ckpt") == []
    step, state = CheckpointManager(d).load(d / "last.ckpt")
    assert step == 3 and torch.equal(state["w"], torch.ones(2) * 3)
    for bad in ("", "a/b", ".hidden", "latest"):
        with pytest.raises(ConfigError, match="save name"):
            CheckpointManager(d).save(4, {"w": torch.ones(2)}, name=bad)


def test_a_corrupt_named_checkpoint_falls_back_to_the_newest_valid_older_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("STEADFAST_EVENTS", str(tmp_path / "events.jsonl"))
    d = tmp_path / "ckpt"
    mgr = CheckpointManager(d, async_save=True)
    for step, name in ((4, "epoch=0.ckpt"), (8, "epoch=1.ckpt"), (9, "last.ckpt")):
        mgr.save(step, {"w": torch.full((2,), float(step))}, name=name)
    mgr.save(12, {"w": torch.zeros(2)}, name="later.ckpt")  # newer: never a fallback
    mgr.close()
    state_file = d / "last.ckpt" / "state.pt"
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        CheckpointManager(d).load(d / "last.ckpt")
    step, state = CheckpointManager(d).load(d / "last.ckpt", fallback=True)
    assert step == 8 and torch.equal(state["w"], torch.full((2,), 8.0))
    evs = read_events(tmp_path / "events.jsonl")
    corrupt = [e for e in evs if e["kind"] == "checkpoint_corrupt"]
    assert corrupt and all(e["path"] == str(d / "last.ckpt") for e in corrupt)


def test_remove_hides_a_named_checkpoint_before_deleting_it(tmp_path: Path):
    d = tmp_path / "ckpt"
    mgr = CheckpointManager(d, async_save=True)
    mgr.save(1, {"w": torch.ones(2)}, name="a.ckpt")
    mgr.remove(d / "a.ckpt")  # waits for the save in flight, then removes it
    mgr.remove(d / "never-there.ckpt")
    mgr.close()
    assert sorted(p.name for p in d.iterdir() if p.name != "events.jsonl") == []


def test_weights_only_false_loads_what_the_safe_loader_refuses(tmp_path: Path):
    d = tmp_path / "ckpt"
    with CheckpointManager(d) as mgr:
        mgr.save(1, {"when": datetime.date(2026, 11, 23)})
    with pytest.raises(CheckpointError, match=r"safe loader .* refuses"):
        CheckpointManager(d).load()
    _, state = CheckpointManager(d).load(d / "step_1", weights_only=False)
    assert state["when"] == datetime.date(2026, 11, 23)


def test_a_name_being_replaced_is_never_missing(tmp_path: Path):
    """Saving ``last.ckpt`` again swaps the new copy in (renameat2 RENAME_EXCHANGE): a
    reader looking all the while never finds the name missing (a framework resolving
    "last" at that moment would otherwise start over)."""
    import threading

    d = tmp_path / "ckpt"
    mgr = CheckpointManager(d, rng=False)
    mgr.save(0, {"w": torch.zeros(1000)}, name="last.ckpt")
    missing, stop = [], threading.Event()

    def look() -> None:
        while not stop.is_set():
            if not (d / "last.ckpt" / "manifest.json").exists():
                missing.append(time.monotonic())

    watcher = threading.Thread(target=look)
    watcher.start()
    try:
        for step in range(1, 30):
            mgr.save(step, {"w": torch.full((1000,), float(step))}, name="last.ckpt")
    finally:
        stop.set()
        watcher.join()
    mgr.close()
    assert not missing
    assert CheckpointManager(d).load(d / "last.ckpt")[0] == 29
    assert sorted(p.name for p in d.iterdir()) == ["last.ckpt"]


def test_hidden_copies_come_back_only_when_they_were_being_replaced(tmp_path: Path):
    """After a crash: a copy hidden while its name was replaced comes back (the newest
    of several, by its manifest), names with '-' included; one hidden to be deleted
    (a framework rotating it out, keep_last_n) never does."""
    d = tmp_path / "ckpt"
    with CheckpointManager(d, rng=False) as mgr:
        mgr.save(7, {"w": torch.ones(2)}, name="epoch=1-step=7.ckpt")
        mgr.save(8, {"w": torch.ones(2) * 8}, name="epoch=1-step=8.ckpt")
        mgr.save(9, {"w": torch.ones(2) * 9}, name="old.ckpt")
    os.rename(d / "epoch=1-step=8.ckpt", d / ".sf-del-epoch=1-step=7.ckpt-999")  # newer
    os.rename(d / "epoch=1-step=7.ckpt", d / ".sf-del-epoch=1-step=7.ckpt-998")
    os.rename(d / "old.ckpt", d / ".sf-rm-old.ckpt-997")
    (d / ".sf-tmp-epoch=1-step=7.ckpt").mkdir()  # the new copy, never finished
    CheckpointManager(d)
    assert sorted(p.name for p in d.iterdir()) == ["epoch=1-step=7.ckpt"]
    assert CheckpointManager(d).load(d / "epoch=1-step=7.ckpt")[0] == 8


def test_a_single_writer_clears_interrupted_saves_only_on_rank_0(tmp_path, monkeypatch):
    """collective=False runs on every rank (each loads on its own), but only the world's
    rank 0 writes: another rank must never delete its save in flight."""
    d = tmp_path / "ckpt"
    (d / ".sf-tmp-last.ckpt").mkdir(parents=True)
    monkeypatch.setenv("RANK", "1")
    CheckpointManager(d, collective=False)
    assert (d / ".sf-tmp-last.ckpt").exists()
    monkeypatch.setenv("RANK", "0")
    CheckpointManager(d, collective=False)
    assert not (d / ".sf-tmp-last.ckpt").exists()


def test_a_fall_back_lands_only_on_a_checkpoint_with_the_same_keys(tmp_path: Path):
    d = tmp_path / "ckpt"
    with CheckpointManager(d, rng=False) as mgr:
        mgr.save(4, {"state_dict": torch.ones(2), "optimizer_states": []}, name="a.ckpt")
        mgr.save(6, {"state_dict": torch.ones(2) * 6}, name="weights.ckpt")
        mgr.save(6, {"state_dict": torch.ones(2) * 7, "optimizer_states": []}, name="last.ckpt")
    (d / "last.ckpt" / "manifest.json").write_text("{")  # its keys cannot be read
    loader = CheckpointManager(d)
    step, _ = loader.load(d / "last.ckpt", fallback=True, require_keys={"optimizer_states"})
    assert step == 4 and loader.loaded_path == d / "a.ckpt"
