"""Preemption pieces in one process: config, sbatch option, log lines, DataLoader
workers that survive the signal."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from steadfast import ConfigError, PreemptionConfig, PreemptionHandler
from steadfast.signals import PREEMPTION_EXIT_CODE, sbatch_signal_option


def test_config_defaults_and_sbatch_option():
    cfg = PreemptionConfig()
    assert (cfg.exit_signal_handler, cfg.exit_signal, cfg.exit_signal_handler_for_dataloader) == (
        False, signal.SIGTERM, False)  # fmt: skip
    assert sbatch_signal_option(60) == "--signal=B:TERM@60"
    assert sbatch_signal_option(120, signal.SIGUSR1) == "--signal=B:USR1@120"
    with pytest.raises(ConfigError, match="exit_signal"):
        PreemptionConfig(exit_signal=999)


def test_signal_is_logged_and_exit_uses_the_documented_code(caplog: pytest.LogCaptureFixture):
    with caplog.at_level("INFO"):
        pre = PreemptionHandler(PreemptionConfig(exit_signal_handler=True)).__enter__()
        assert not pre.should_exit(0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert pre.should_exit(1)
        with pytest.raises(SystemExit) as info:
            pre.exit()
    assert info.value.code == PREEMPTION_EXIT_CODE == 0
    text = caplog.text
    assert "Signal handler installed for 15" in text
    assert "Received signal 15, initiating graceful stop" in text
    assert "exiting program after receiving SIGTERM." in text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_disabled_handler_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler(PreemptionConfig()) as pre:
        assert signal.getsignal(signal.SIGTERM) is before and not pre.should_exit(0)


class _Slow(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.05)
        return torch.tensor([i, os.getpid()])


@pytest.mark.parametrize("for_dataloader", [True, False])
def test_dataloader_workers_survive_the_signal(for_dataloader: bool):
    pre = PreemptionHandler(
        PreemptionConfig(
            exit_signal_handler=True, exit_signal_handler_for_dataloader=for_dataloader
        )
    )
    loader = DataLoader(
        _Slow(), batch_size=1, num_workers=1, worker_init_fn=pre.dataloader_worker_init
    )
    seen = []
    for batch in loader:
        seen.append(int(batch[0, 0]))
        if len(seen) == 2:
            os.kill(int(batch[0, 1]), signal.SIGTERM)  # to the worker, mid-epoch
    assert seen == list(range(8))  # no worker died, no batch lost
