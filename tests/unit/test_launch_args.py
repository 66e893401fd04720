"""`steadfast launch` command line: torchrun's flags pass through, --ft-* flags become the
FT config, and nothing after the training script is taken by the launcher."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.distributed import run as torchrun

from steadfast import ConfigError
from steadfast.launcher import main
from steadfast.launcher.args import split_argv


def _split(argv: list[str]):
    return split_argv(argv, torchrun.get_args_parser())


def test_ft_flags_are_taken_and_torchrun_flags_pass_through():
    split = _split([
        "--nproc-per-node", "2", "--max-restarts=3",
        "--ft-param-rank_section_timeouts=setup:600,step:180,checkpointing:420",
        "--ft-rank_out_of_section_timeout", "300",
        "--ft-param-rank-heartbeat-timeout", "null",
        "--rdzv-endpoint", "host:29500",
        "train.py", "--ft-param-safety_factor=9", "--nproc-per-node", "7",
    ])  # fmt: skip
    assert split.torchrun_argv == [
        "--nproc-per-node", "2", "--max-restarts=3", "--rdzv-endpoint", "host:29500",
        "train.py", "--ft-param-safety_factor=9", "--nproc-per-node", "7",
    ]  # fmt: skip
    ft = split.ft
    assert ft.rank_section_timeouts == {"setup": 600, "step": 180, "checkpointing": 420}
    assert ft.rank_out_of_section_timeout == 300 and ft.rank_heartbeat_timeout is None
    assert ft.safety_factor == 5.0  # the script's own flag was not taken


def test_abbreviated_torchrun_flags_keep_their_values():
    split = _split(["--nnode", "2", "--ft-safety_factor=3", "train.py"])
    assert split.torchrun_argv == ["--nnode", "2", "train.py"] and split.ft.safety_factor == 3


def test_module_and_yaml(tmp_path: Path):
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  rank_section_timeouts: {step: 10}\n  safety_factor: 3\n")
    split = _split(["--ft-cfg-path", str(cfg), "--ft-safety_factor=4", "-m", "pkg.train", "-x"])
    assert split.torchrun_argv == ["-m", "pkg.train", "-x"]
    assert split.ft.rank_section_timeouts == {"step": 10.0} and split.ft.safety_factor == 4.0


def test_bad_ft_flag_is_one_clear_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(
        ConfigError, match="--ft-param-step_timeout=3: unknown fault_tolerance field"
    ):
        _split(["--ft-param-step_timeout=3", "train.py"])
    assert main(["--nproc-per-node=1", "--ft-rank_heartbeat_timeout", "-5", "train.py"]) == 2
    assert "rank_heartbeat_timeout: must be > 0" in capsys.readouterr().err


def test_event_log_flags_are_taken_and_resolved(tmp_path: Path):
    from steadfast.launcher.args import resolve_events_path

    split = _split(["--run-dir", "runs/a", "--nproc-per-node=2", "t.py", "--events", "x"])
    assert split.run_dir == "runs/a" and split.events is None  # the script's own --events
    assert split.torchrun_argv == ["--nproc-per-node=2", "t.py", "--events", "x"]
    assert _split(["--events=e.jsonl", "t.py"]).events == "e.jsonl"
    env = {"STEADFAST_EVENTS": "/inherited.jsonl"}
    assert resolve_events_path("e.jsonl", None, env) == os.path.abspath("e.jsonl")
    assert resolve_events_path(None, "runs/a", env) == os.path.abspath("runs/a/events.jsonl")
    assert resolve_events_path(None, None, env) == "/inherited.jsonl"
    assert resolve_events_path(None, None, {"STEADFAST_EVENTS": "off"}) == "off"
    assert resolve_events_path(None, None, {}) == os.path.abspath("steadfast_events.jsonl")
    with pytest.raises(ConfigError, match="not both"):
        resolve_events_path("a", "b", {})
    with pytest.raises(ConfigError, match="--run-dir"):
        _split(["--run-dir="])


def test_an_abbreviated_steadfast_flag_is_an_error_not_ignored(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--run-d", "x", "--nproc-per-node=1", "t.py"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --run-d" in capsys.readouterr().err
    assert _split(["--run_dir", "r", "t.py"]).run_dir == "r"  # torchrun's _ spelling too


def test_script_flags_that_look_like_steadfasts_are_the_scripts(capsys):
    """A script's own --fault (a prefix of --fault-tol-cfg-path) or --events reaches it."""
    split = _split(["--nproc-per-node=1", "t.py", "--fault", "x", "--events", "e"])
    assert split.torchrun_argv == ["--nproc-per-node=1", "t.py", "--fault", "x", "--events", "e"]
    assert split.events is None
    args = torchrun.get_args_parser().parse_args(split.torchrun_argv)
    assert args.training_script_args == ["--fault", "x", "--events", "e"]


def test_a_script_flag_that_abbreviates_a_torchrun_flag_is_the_scripts():
    """A script's --signal abbreviates torchrun's --signals-to-handle: under Python < 3.12
    argparse calls it ambiguous wherever it stands, so plain torchrun refuses the command
    line. The launcher shows torch's parser only the flags and the script."""
    parser = torchrun.get_args_parser()
    split = split_argv(["--nproc-per-node=2", "t.py", "--signal", "USR1", "--sig=x"], parser)
    args = split.parse(parser)
    assert args.training_script == "t.py" and args.nproc_per_node == "2"
    assert args.training_script_args == ["--signal", "USR1", "--sig=x"]


def test_help_lists_steadfasts_flags(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--ft-cfg-path" in out and "--term-timeout" in out and "--nproc-per-node" in out


def test_the_rank_that_exited_first_is_the_failure():
    from types import SimpleNamespace as F

    from steadfast.launcher.agent import first_failures

    killed = F(local_rank=1, exitcode=-9, timestamp=100)
    lost_peer = F(local_rank=0, exitcode=1, timestamp=100)
    failures = {0: lost_peer, 1: killed}
    assert first_failures(failures, {1: 5.0, 0: 5.2}) == {1}  # the watcher's order
    assert first_failures(failures, {1: 5.2, 0: 5.0}) == {0}
    # seen in one wake-up: the rank killed by a signal is the fault, not the one that exited
    assert first_failures(failures, {1: 5.0, 0: 5.0}) == {1}
    both_exited = {
        0: F(local_rank=0, exitcode=1, timestamp=7),
        1: F(local_rank=1, exitcode=3, timestamp=7),
    }
    assert first_failures(both_exited, {0: 5.0, 1: 5.0}) == {0, 1}  # no way to tell: both
    assert first_failures(both_exited, {}) == {0, 1}  # no pidfds: torch's 1 s timestamps
    assert first_failures({}, {}) == set()


def test_nvrx_launcher_flags(tmp_path: Path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    split = _split([
        "--fault-tol-cfg-path", str(empty), "--ft-safety-factor=3", "--term-timeout", "60",
        "--workers_stop_timeout", "9", "--ft-restart-policy", "any-failed",
        "--ignore-missing-fault-tol-cfg", "--nproc-per-node=2", "t.py",
    ])  # fmt: skip
    assert split.torchrun_argv == ["--nproc-per-node=2", "t.py"]
    assert split.ft.safety_factor == 3 and split.ft.workers_stop_timeout == 9
    assert split.term_timeout == 60 and split.restart_policy == "any-failed"
    with pytest.raises(ConfigError, match="min-healthy: not supported"):
        _split(["--ft-restart-policy=min-healthy", "t.py"])
    with pytest.raises(ConfigError, match="no 'fault_tolerance:' section"):
        _split(["--ft-cfg-path", str(empty), "t.py"])  # nothing else gives a config
    with pytest.raises(ConfigError, match="--term-timeout: expected seconds"):
        _split(["--term-timeout", "soon", "t.py"])
