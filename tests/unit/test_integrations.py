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
    position.sampler.set_epoch(3)  # what Lightning's fit loop calls at an epoch's start
    assert position.epoch == 3 and sampler.epoch == 3
    assert resumable(_Unsized()).lookahead == 1


class _Unsized:
    def __iter__(self):
        yield from range(4)
