"""The framework integrations are extras: ``import steadfast`` never imports them (nor
their frameworks), and their arguments fail with a readable error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def test_import_steadfast_imports_no_framework():
    code = (
        "import sys, steadfast, steadfast.integrations\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="no Lightning")
def test_nvrx_simulated_fault_params_are_checked_and_mapped():
    from steadfast.integrations.lightning import FaultToleranceCallback

    with pytest.raises(ValueError, match=r"simulated_fault_params\.fault_type: 'bogus'"):
        FaultToleranceCallback(simulated_fault_params={"fault_type": "bogus", "base_delay": 1})
    cb = FaultToleranceCallback(
        autoresume=False,
        calculate_timeouts=True,
        simulated_fault_params={"fault_type": "rank_hung", "base_delay": 2, "rank_to_fail": 1},
    )
    assert cb.simulated_fault_params == {
        "simulated_fault_type": "rank_hung",
        "simulated_fault_base_delay": 2.0,
        "extra_delay_max": 0.0,
        "simulated_fault_rank": 1,
    }


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_the_trainer_callbacks_are_trainer_callbacks():
    from transformers import TrainerCallback

    from steadfast.integrations import transformers as hf

    for cls in (hf.FaultToleranceCallback, hf.GracefulShutdownCallback, hf.NaNCallback):
        assert issubclass(cls, TrainerCallback)
    with pytest.raises(Exception, match=r"NaNDetector\.action"):
        hf.NaNCallback(action="ignore")


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="no Lightning")
def test_resumable_is_driven_by_lightning_and_refuses_an_undistributed_loader(monkeypatch):
    """Lightning sets the epoch through the loader's ``sampler.set_epoch``; it draws a
    batch ahead only from a loader without a length; and a loader whose sampler is not
    per-rank is refused under DDP (Lightning would not add a DistributedSampler)."""
    from torch.utils.data import DataLoader

    from steadfast import ConfigError, ResumableSampler
    from steadfast.integrations.lightning import resumable

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="sampler is a SequentialSampler"):
        resumable(DataLoader(range(8), batch_size=2))
    sampler = ResumableSampler(8, num_replicas=2, rank=1, seed=5)
    position = resumable(DataLoader(range(8), batch_size=2, sampler=sampler))
    assert position.lookahead == 0 and len(position) == 2
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(position, 3)  # what Lightning's fit loop calls at an epoch's start
    assert position.epoch == 3 and sampler.epoch == 3
    assert resumable(_Unsized()).lookahead == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="RandomSampler"):
        resumable(DataLoader(range(8), batch_size=2, shuffle=True))


class _Unsized:
    def __iter__(self):
        yield from range(4)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_last_verified_checkpoint_skips_cut_short_and_damaged_checkpoints(tmp_path):
    """The Trainer's checkpoint-N folders, sealed by write_manifest as
    VerifiedCheckpointCallback does from the step in its marker on: the newest whole one
    is chosen; one without a manifest newer than the marker's step (the job died writing
    it) or with a flipped byte is passed over; one older than the marker's step, or any
    in a folder never sealed, predates the callback and is taken as the Trainer would."""
    import json

    from steadfast import CheckpointError
    from steadfast.checkpoint import write_manifest
    from steadfast.integrations.transformers import SEALED_SINCE, last_verified_checkpoint

    assert last_verified_checkpoint(tmp_path / "none") is None
    for n in (2, 4, 6, 10):
        (tmp_path / f"checkpoint-{n}").mkdir()
        (tmp_path / f"checkpoint-{n}" / "model.safetensors").write_bytes(bytes([n]) * 64)
    (tmp_path / "checkpoint-x").mkdir()  # not the Trainer's name: ignored
    assert last_verified_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # unsealed
    (tmp_path / SEALED_SINCE).write_text(json.dumps({"since_step": 2}))
    for n in (4, 6):
        write_manifest(tmp_path / f"checkpoint-{n}", n)
    (tmp_path / "checkpoint-6" / "model.safetensors").write_bytes(b"\xff" * 64)
    assert last_verified_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4" / "model.safetensors").unlink()
    # checkpoint-2 predates the sealing: taken, unverified
    assert last_verified_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    write_manifest(tmp_path / "checkpoint-2", 2)
    (tmp_path / "checkpoint-2" / "model.safetensors").write_bytes(b"\xff" * 63)
    with pytest.raises(CheckpointError, match=r"checksum mismatch.*missing.*63 bytes"):
        last_verified_checkpoint(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="no Lightning")
def test_steadfast_checkpoint_io_round_trip_and_fall_backs(tmp_path):
    """Lightning's calls, as its strategy makes them: saves (async) are verified folders;
    remove_checkpoint deletes; a ``last.ckpt`` link whose target a crash kept from
    landing falls back to the newest full checkpoint, never a weights-only one; a plain
    ``.ckpt`` file from Lightning's own writer still loads."""
    import torch

    from steadfast.checkpoint import verify
    from steadfast.integrations.lightning import SteadfastCheckpointIO

    io = SteadfastCheckpointIO(async_save=True)
    full = {"global_step": 4, "state_dict": {"w": torch.ones(3)}, "loops": {},
            "optimizer_states": [{}]}  # fmt: skip
    io.save_checkpoint(full, tmp_path / "epoch=0-step=4.ckpt")
    io.save_checkpoint({**full, "global_step": 8}, tmp_path / "epoch=1-step=8.ckpt")
    io.save_checkpoint(
        {"global_step": 9, "state_dict": {"w": torch.zeros(3)}, "loops": {}},
        tmp_path / "weights-only.ckpt",
    )
    io.remove_checkpoint(tmp_path / "epoch=1-step=8.ckpt")
    io.teardown()  # waits for the writes
    assert verify(tmp_path / "epoch=0-step=4.ckpt") == []
    assert not (tmp_path / "epoch=1-step=8.ckpt").exists()
    (tmp_path / "last.ckpt").symlink_to("epoch=1-step=8.ckpt")  # save_last="link"
    loaded = SteadfastCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], torch.ones(3))
    torch.save(full, tmp_path / "plain.ckpt")
    assert SteadfastCheckpointIO().load_checkpoint(tmp_path / "plain.ckpt")["global_step"] == 4
    with pytest.raises(FileNotFoundError):
        SteadfastCheckpointIO().load_checkpoint(tmp_path / "never.ckpt")


def test_the_step_timer_times_training_forwards_and_whole_steps_when_it_sees_none():
    """The Trainer's straggler timer: with a module, its training forwards are the
    samples (an evaluation's forward and a whole step are not); with no forward seen in a
    step (a compiled model), the next steps are timed whole; ``close`` removes the hooks."""
    import time

    import torch

    from steadfast.integrations._common import StepTimer
    from steadfast.straggler.manager import NVRxStragglerDetectionConfig

    class Slow(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return super().forward(x)

    def samples(timer: StepTimer) -> list[float]:
        section = timer.manager.detector._sections["train_step"]
        return [took / 1e9 for _, took, _ in section.samples]

    timer = StepTimer(NVRxStragglerDetectionConfig(enabled=True, report_time_interval=1e6))
    net = Slow(2, 2)
    timer.time_forwards(net)
    timer.begin()
    began = time.perf_counter()
    net(torch.ones(1, 2))
    forward = time.perf_counter() - began
    time.sleep(0.05)  # the rest of the step: not a forward
    with torch.no_grad():
        net.eval()
        net(torch.ones(1, 2))  # an evaluation
        net.train()
    timer.end(1)
    [sample] = samples(timer)
    assert 0.02 <= sample <= forward
    timer.begin()
    time.sleep(0.03)  # a step whose forward is not seen
    timer.end(2)
    timer.begin()
    time.sleep(0.06)  # so this one is timed whole
    timer.end(3)
    assert len(samples(timer)) == 2 and samples(timer)[1] >= 0.06
    timer.close()
    assert not net._forward_pre_hooks and not net._forward_hooks
