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


def test_one_parser_of_signal_names_for_configs_and_the_batch_script():
    """``parse_signal`` takes a name with or without ``SIG`` in any case, a number (also
    as text) or a signal, and names the field of anything else; the preemption config,
    the monitor's config, the batch script and its ``--signal=B:`` option all use it."""
    from steadfast.config import FaultToleranceConfig, parse_signal
    from steadfast.signals import signal_name
    from steadfast.slurm import SbatchSpec

    for value in ("SIGUSR1", "USR1", " usr1 ", "10", 10, signal.SIGUSR1):
        assert parse_signal(value, "f") is signal.SIGUSR1
    for value in ("SIGFOO", "", "-1", 999, True, None, 1.0):
        with pytest.raises(ConfigError, match=r"^f: .* is not a signal \(e.g. SIGKILL"):
            parse_signal(value, "f")
    assert PreemptionConfig(exit_signal="USR2").exit_signal is signal.SIGUSR2
    assert FaultToleranceConfig(rank_termination_signal="15").rank_termination_signal == 15
    assert SbatchSpec(script="t.py", preempt_signal="12").preempt_signal == "USR2"
    assert sbatch_signal_option(30, "usr2") == sbatch_signal_option(30, 12) == "--signal=B:USR2@30"
    spec = SbatchSpec(script="t.py", time="10", preempt_signal="SIGUSR2", preempt_time=30)
    assert "--signal=B:USR2@30" in spec.sbatch_options()
    assert (signal_name(15), signal_name(signal.SIGRTMIN + 2)) == (
        "SIGTERM", f"SIG{signal.SIGRTMIN + 2}")  # fmt: skip
