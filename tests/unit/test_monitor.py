"""Rank monitoring: FT config, the shared-memory table, the client, and the watcher
terminating real hung processes."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from steadfast import ConfigError, FaultToleranceConfig
from steadfast.events import read_events
from steadfast.monitor import (
    FT_CONFIG_ENV,
    HB_TABLE_ENV,
    HeartbeatTable,
    HeartbeatTimeouts,
    RankMonitorClient,
    RankMonitorClientError,
    Watcher,
    load_ft_state,
    save_ft_state,
)
from steadfast.monitor.watcher import HELD_GRACE, next_deadline


# ---------------------------------------------------------------------- config
def test_config_defaults_are_the_originals():
    cfg = FaultToleranceConfig()
    assert cfg.workload_check_interval == 5.0 and cfg.safety_factor == 5.0
    # NVRx 0.4.1: a first heartbeat within an hour, then one every 45 minutes
    assert cfg.initial_rank_heartbeat_timeout == 3600 and cfg.rank_heartbeat_timeout == 2700
    assert cfg.rank_section_timeouts == {} and cfg.rank_out_of_section_timeout is None
    assert cfg.rank_termination_signal == signal.SIGKILL and cfg.log_level == logging.INFO
    assert cfg.num_warmup_iterations == 5


def test_config_from_yaml_and_flags(tmp_path: Path):
    f = tmp_path / "ft.yaml"
    f.write_text(
        textwrap.dedent("""
        fault_tolerance:
            initial_rank_heartbeat_timeout: null
            rank_heartbeat_timeout: null
            rank_section_timeouts:
                init: 20
                step: 10
                checkpoint: 30
            rank_out_of_section_timeout: 30
            log_level: "DEBUG"
            rank_termination_signal: SIGTERM
    """)
    )
    cfg = FaultToleranceConfig.from_yaml_file(f)
    assert cfg.rank_section_timeouts == {"init": 20.0, "step": 10.0, "checkpoint": 30.0}
    assert cfg.rank_termination_signal == signal.SIGTERM and cfg.log_level == logging.DEBUG
    cfg = cfg.with_overrides(
        {
            "rank_section_timeouts": "setup:600,step:180,checkpointing:null",
            "rank_out_of_section_timeout": "null",
            "safety_factor": "2.5",
        }
    )
    assert cfg.rank_section_timeouts == {"setup": 600.0, "step": 180.0, "checkpointing": None}
    assert cfg.rank_out_of_section_timeout is None and cfg.safety_factor == 2.5
    assert json.loads(json.dumps(cfg.to_dict()))["rank_termination_signal"] == "SIGTERM"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FaultToleranceConfig(rank_heartbeat_timeout=-1), "rank_heartbeat_timeout"),
        (
            lambda: FaultToleranceConfig(rank_section_timeouts={"step": "x"}),
            "rank_section_timeouts.step",
        ),
        (lambda: FaultToleranceConfig(rank_termination_signal="SIGNOPE"), "not a signal"),
        (lambda: FaultToleranceConfig(log_level="LOUD"), "log_level"),
        (lambda: FaultToleranceConfig().with_overrides({"bogus": "1"}), "--ft-param-bogus"),
        (
            lambda: FaultToleranceConfig().with_overrides({"rank_section_timeouts": "step"}),
            "name:seconds",
        ),
        (lambda: FaultToleranceConfig.from_mapping({"typo_field": 1}), "typo_field"),
    ],
)
def test_bad_config_names_the_field(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_yaml_without_section_is_a_clear_error(tmp_path: Path):
    f = tmp_path / "ft.yaml"
    f.write_text("something_else: {}\n")
    with pytest.raises(ConfigError, match="no 'fault_tolerance:' section"):
        FaultToleranceConfig.from_yaml_file(f)


# ---------------------------------------------------------------------- table + client
@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch):
    tab = HeartbeatTable.create(rows=2)
    tab.reset(0, {"step": 10.0}, None, None, None)
    tab.reset(1, {}, None, None, None)
    monkeypatch.setenv(HB_TABLE_ENV, str(tab.path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(FT_CONFIG_ENV, json.dumps({"safety_factor": 2.0}))
    yield tab
    tab.close()
    assert not tab.path.exists()


def test_client_writes_its_row(table: HeartbeatTable):
    client = RankMonitorClient()
    with pytest.raises(RankMonitorClientError, match="not initialized"):
        client.send_heartbeat()
    client.init_workload_monitoring()
    with pytest.raises(RankMonitorClientError, match="already initialized"):
        client.init_workload_monitoring()
    snap = table.snapshot(0)
    assert snap.pid == os.getpid() and snap.last_heartbeat == 0 and snap.open_sections == {}
    client.send_heartbeat()
    client.start_section(section="setup")  # a name the launcher did not know; NVRx's keyword
    snap = table.snapshot(0)
    assert list(snap.open_sections) == ["setup"] and snap.last_heartbeat > 0
    assert snap.section_timeouts == {"step": 10.0, "setup": math.inf}
    client.start_section("step")  # nested, as NVRx allows
    assert set(table.snapshot(0).open_sections) == {"setup", "step"}
    with pytest.raises(RankMonitorClientError, match="'step' is already open"):
        client.start_section("step")
    client.end_section("setup")  # overlapping: the outer one closes first
    client.end_section("step")
    with pytest.raises(RankMonitorClientError, match=r"'step'.*not open"):
        client.end_section("step")
    snap = table.snapshot(0)
    assert snap.steps == 1 and snap.out_of_section_start > 0 and snap.open_sections == {}
    client.start_section("setup")
    client.start_section("step")
    client.end_all_sections()
    assert table.snapshot(0).open_sections == {} and table.snapshot(0).steps == 2
    assert table.snapshot(1).pid == 0  # other rows untouched
    client.shutdown_workload_monitoring()
    assert table.snapshot(0).closed


def test_out_of_section_is_not_watched_before_the_first_step(table: HeartbeatTable):
    client = RankMonitorClient()
    client.init_workload_monitoring()
    client.start_section("setup")
    client.end_section("setup")
    assert table.snapshot(0).out_of_section_start == 0
    client.shutdown_workload_monitoring()


def test_calculated_timeouts_and_ft_state(table: HeartbeatTable, tmp_path: Path):
    client = RankMonitorClient()
    client.init_workload_monitoring()
    assert client.hb_timeouts == HeartbeatTimeouts(3600.0, 2700.0, False)  # the defaults
    with pytest.raises(RankMonitorClientError, match="Not enough data"):
        client.calculate_and_set_hb_timeouts()  # no heartbeat yet
    assert client.calculate_and_set_section_timeouts(["step"], skip_if_not_ready=True) is False
    for _ in range(3):
        client.send_heartbeat()
        client.start_section("step")
        time.sleep(0.01)
        client.end_section("step")
    assert client.calculate_and_set_hb_timeouts()
    assert client.calculate_and_set_section_timeouts()
    hb, sections = client.hb_timeouts, client.section_timeouts
    assert hb is not None and hb.were_calculated and hb.are_valid
    assert sections is not None and sections.calculated_sections == {"step"}
    step_timeout = sections.section["step"]
    assert step_timeout is not None and 2 * 0.01 <= step_timeout < 2 * 5  # safety x max seen
    # the watcher waits at least calculated_timeout_floor (1 s): a calculated 0.03 s
    # would end a healthy rank at its first pause
    floor = client.cfg.calculated_timeout_floor if client.cfg is not None else 0.0
    assert table.snapshot(0).section_timeouts["step"] == max(step_timeout, floor)
    assert table.snapshot(0).heartbeat_timeout == max(hb.subsequent, floor)
    state = client.state_dict()  # NVRx's form
    assert set(state["current_timeouts"]) == {"heartbeat", "section"}
    assert state["current_timeouts"]["section"]["calculated_sections"] == ["step"]
    client.calculate_and_set_section_timeouts()  # merged: 0.5 new + 0.5 current
    path = tmp_path / "ft_state.json"
    save_ft_state(client, path)
    client.shutdown_workload_monitoring()
    table.reset(0, {"step": 10.0}, None, None, None)  # a restart
    fresh = RankMonitorClient()
    assert load_ft_state(fresh, path)  # before init, as NVRx allows
    fresh.init_workload_monitoring()
    assert fresh.state_dict() == json.loads(path.read_text())
    saved = fresh.state_dict()["current_timeouts"]["section"]["section"]["step"]
    assert table.snapshot(0).section_timeouts["step"] == max(saved, floor)
    path.write_text('{"rank_heartbeat_timeout": -3}')  # steadfast's earlier flat form
    with pytest.raises(ConfigError, match=r"ft_state\.json: ft state\.rank_heartbeat_timeout"):
        load_ft_state(fresh, path)
    path.write_text('{"rank_section_timeouts": {"step": 4.0}}')
    assert load_ft_state(fresh, path) and table.snapshot(0).section_timeouts["step"] == 4.0
    assert not load_ft_state(fresh, tmp_path / "missing.json")
    fresh.shutdown_workload_monitoring()


def test_client_outside_the_launcher_is_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(HB_TABLE_ENV, raising=False)
    with pytest.raises(ConfigError, match="steadfast launch"):
        RankMonitorClient().init_workload_monitoring()


def test_deadlines():
    from steadfast.monitor import table as t

    tab = HeartbeatTable.create(rows=1)
    try:
        tab.reset(0, {"step": 2.0, "warmup": 9.0}, 30.0, 5.0, 4.0)
        s = tab.slots(0)
        snap = tab.snapshot(0)
        assert next_deadline(snap, 100.0, 2)[:2] == (130.0, "initial_heartbeat")
        s[t.ATTACHED] = 110.0  # once attached, the first heartbeat is due from its attach
        assert next_deadline(tab.snapshot(0), 100.0, 2)[:2] == (140.0, "initial_heartbeat")
        s[t.LAST_HB] = 200.0  # a heartbeat at t=200
        s[t.OPENED + 0], s[t.OPEN] = 201.0, 1.0  # in a step (index 0): the warm-up timeout
        assert next_deadline(tab.snapshot(0), 100.0, 2)[:2] == (205.0, "heartbeat")
        s[t.STEPS] = 5.0  # past warm-up: the step timeout applies
        assert next_deadline(tab.snapshot(0), 100.0, 2)[:2] == (203.0, "section:step")
        s[t.OPENED + 1], s[t.OPEN] = 200.5, 2.0  # "warmup" opened around it: nested
        assert next_deadline(tab.snapshot(0), 100.0, 2)[:2] == (203.0, "section:step")
        s[t.OPENED + 0] = s[t.OPENED + 1] = s[t.OPEN] = 0.0
        s[t.OOS_START] = 210.0  # out of section since t=210
        assert next_deadline(tab.snapshot(0), 100.0, 2)[:2] == (205.0, "heartbeat")
        s[t.HB_TIMEOUT] = math.inf
        assert next_deadline(tab.snapshot(0), 100.0, 2)[:2] == (214.0, "out_of_section")
    finally:
        tab.close()


# ---------------------------------------------------------------------- watcher, real hangs
_WORKER = """
import os, signal, sys, time
from steadfast.monitor import RankMonitorClient
mode = sys.argv[1]
c = RankMonitorClient()
if mode != "never_attaches":
    c.init_workload_monitoring()
print("ready", flush=True)
if mode == "hang_in_step":
    c.send_heartbeat()
    for _ in range(3):
        c.start_section("step"); c.end_section("step")
    c.start_section("step")
    time.sleep(60)
elif mode == "hang_out_of_section":
    c.send_heartbeat()
    c.start_section("step"); c.end_section("step")
    time.sleep(60)
elif mode == "stopped":
    c.send_heartbeat()
    c.start_section("step")
    os.kill(os.getpid(), signal.SIGSTOP)
elif mode == "lowered":  # a section open under a long timeout, then a short one loaded
    c.send_heartbeat()
    c.start_section("step")
    time.sleep(0.3)  # the watcher has read the row and sleeps to a far deadline
    c.load_state_dict({"rank_section_timeouts": {"step": 0.5}})
    time.sleep(60)
elif mode == "ignores_sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    c.send_heartbeat()
    c.start_section("step")
    time.sleep(60)
elif mode == "clean":
    c.send_heartbeat()
    c.start_section("step"); c.end_section("step")
    c.shutdown_workload_monitoring()
    time.sleep(1.5)
    sys.exit(0)
time.sleep(60)
"""


def _table_for(cfg: FaultToleranceConfig) -> HeartbeatTable:
    """A one-row table reset to ``cfg``'s timeouts, as the launcher does per generation."""
    tab = HeartbeatTable.create(rows=1)
    tab.reset(
        0,
        cfg.rank_section_timeouts,
        cfg.initial_rank_heartbeat_timeout,
        cfg.rank_heartbeat_timeout,
        cfg.rank_out_of_section_timeout,
    )
    return tab


def _worker_env(tab: HeartbeatTable, cfg: FaultToleranceConfig) -> dict[str, str]:
    """The environment the launcher gives local rank 0."""
    return dict(
        os.environ,
        **{
            HB_TABLE_ENV: str(tab.path),
            "LOCAL_RANK": "0",
            FT_CONFIG_ENV: json.dumps(cfg.to_dict()),
        },
    )


@pytest.mark.parametrize(
    ("mode", "what"),
    [
        ("hang_in_step", "section:step"),
        ("hang_out_of_section", "out_of_section"),
        ("never_attaches", "initial_heartbeat"),
        ("stopped", "section:step"),  # the rank_hung simulation: SIGSTOP itself
    ],
)
def test_watcher_terminates_a_hung_rank(event_log: Path, mode: str, what: str):
    cfg = FaultToleranceConfig(
        initial_rank_heartbeat_timeout=1.5,
        rank_heartbeat_timeout=30,
        rank_section_timeouts={"step": 0.5},
        rank_out_of_section_timeout=0.5,
        workload_check_interval=0.2,
    )
    tab = _table_for(cfg)
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, mode],
        env=_worker_env(tab, cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    watcher = Watcher(tab, cfg, global_rank=lambda local: local + 4)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        watcher.start()
        watcher.watch({0: proc.pid})
        _, err = proc.communicate(timeout=30)
    finally:
        watcher.stop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        tab.close()
    assert proc.returncode == -signal.SIGKILL  # rank_termination_signal
    [hang] = watcher.hangs
    assert hang.what == what and hang.elapsed >= hang.timeout
    [event] = [
        e for e in map(json.loads, event_log.read_text().splitlines()) if e["kind"] == "rank_hung"
    ]
    assert event["rank"] == 4 and event["cause"] == what and event["worker_pid"] == proc.pid
    if mode != "never_attaches":  # its stacks reached the rank's log first
        assert "most recent call first" in err and "<module>" in err


def test_watcher_leaves_a_rank_that_shut_down_alone():
    cfg = FaultToleranceConfig(
        rank_section_timeouts={"step": 0.3},
        rank_out_of_section_timeout=0.3,
        workload_check_interval=0.1,
    )
    tab = _table_for(cfg)
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, "clean"],
        env=_worker_env(tab, cfg),
        stdout=subprocess.PIPE,
        text=True,
    )
    watcher = Watcher(tab, cfg)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        watcher.start()
        watcher.watch({0: proc.pid})
        proc.communicate(timeout=30)
    finally:
        watcher.stop()
        tab.close()
    assert proc.returncode == 0 and watcher.hangs == []


def test_a_table_left_by_a_killed_launcher_is_removed(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(proc.stdout)  # a pid that no longer runs
    orphan = tmp_path / f"steadfast-hb-{dead}-deadbeef"
    orphan.write_bytes(b"\0" * 4096)
    os.mkfifo(tmp_path / f"steadfast-hbwake-{dead}-deadbeef")  # its wake channel, just made
    os.mkfifo(tmp_path / f"steadfast-hbask-{dead}-deadbeef-0")  # and its row's ask channel
    mine = HeartbeatTable.create(rows=1, directory=tmp_path)
    try:
        assert not orphan.exists() and mine.path.exists()
        # the channel goes with its table at once, however young (a requeued job's
        # launcher sweeps the killed one's within seconds)
        name = mine.path.name.removeprefix("steadfast-hb-")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [mine.path.name, f"steadfast-hbwake-{name}", f"steadfast-hbask-{name}-0"]
        )
    finally:
        mine.close()


def test_a_writer_that_died_mid_update_does_not_block_readers():
    tab = HeartbeatTable.create(rows=1)
    try:
        tab.reset(0, {"step": 1.0}, None, None, None)
        s = tab.slots(0)
        s[0] += 1  # a rank killed between the two halves of its seqlock update
        assert tab.snapshot(0).section_timeouts == {"step": 1.0}  # read as it is, no hang
        tab.reset(0, {"step": 2.0}, None, None, None)  # the next generation's row
        assert int(s[0]) % 2 == 0 and tab.snapshot(0).section_timeouts == {"step": 2.0}
    finally:
        tab.close()


def test_watcher_does_not_act_on_a_worker_that_already_exited(event_log: Path):
    cfg = FaultToleranceConfig(initial_rank_heartbeat_timeout=0.2, workload_check_interval=0.1)
    tab = _table_for(cfg)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # gone (and reaped) before its first heartbeat was due
    watcher = Watcher(tab, cfg)
    try:
        watcher.start()
        watcher.watch({0: proc.pid})
        time.sleep(0.6)
    finally:
        watcher.stop()
        tab.close()
    assert watcher.hangs == [] and not event_log.exists()


def _start_workers(tab: HeartbeatTable, cfg: FaultToleranceConfig, *modes: str):
    """One worker process per row of ``tab``, each past its ``ready`` line."""
    procs = []
    for row, mode in enumerate(modes):
        env = dict(_worker_env(tab, cfg), LOCAL_RANK=str(row))
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return procs


def _finish(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_a_lowered_timeout_wakes_the_watcher(event_log: Path):
    """The watcher read the row under a 60 s step timeout and sleeps to a far deadline
    (workload_check_interval 30 s); the rank then loads a 0.5 s timeout: the hang is
    seen when the new timeout ends, not 30 s later."""
    cfg = FaultToleranceConfig(
        rank_section_timeouts={"step": 60},
        workload_check_interval=30,
        calculated_timeout_floor=0.1,  # a loaded (calculated) timeout: enforced from 0.1 s
    )
    tab = _table_for(cfg)
    [proc] = _start_workers(tab, cfg, "lowered")
    watcher = Watcher(tab, cfg)
    try:
        watcher.start()
        watcher.watch({0: proc.pid})
        proc.wait(20)
    finally:
        watcher.stop()
        _finish([proc])
        tab.close()
    [hang] = watcher.hangs
    assert hang.timeout == 0.5 and hang.elapsed - hang.timeout < 5.0, hang


def test_a_rank_ignoring_sigterm_is_killed_and_a_rank_hung_beside_it_is_one_fault_until(
    event_log: Path,
):
    """Both ranks hang in their step (0.5 s): one fault, so the first to time out is
    ended and the other waits for it to be gone (it would go down with it, had it waited
    for it in a collective); these two are unrelated, so the second is ended on its own
    HELD_GRACE after the first's exit. Rank 0 ignores the termination signal: SIGKILL
    follows after workers_stop_timeout (2 s)."""
    cfg = FaultToleranceConfig(
        rank_section_timeouts={"step": 0.5},
        rank_termination_signal=signal.SIGTERM,
        workers_stop_timeout=2.0,
    )
    tab = HeartbeatTable.create(rows=2)
    for row in range(2):
        tab.reset(row, cfg.rank_section_timeouts, None, None, None)
    procs = _start_workers(tab, cfg, "ignores_sigterm", "hang_in_step")
    watcher = Watcher(tab, cfg)
    try:
        watcher.start()
        watcher.watch({row: p.pid for row, p in enumerate(procs)})
        for proc in procs:
            proc.wait(30)
        exits = watcher.exit_times()
    finally:
        watcher.stop()
        _finish(procs)
        tab.close()
    assert procs[0].returncode == -signal.SIGKILL  # it ignored SIGTERM
    assert procs[1].returncode == -signal.SIGTERM
    first, second = watcher.hangs
    assert {first.local_rank, second.local_rank} == {0, 1}
    assert exits[first.local_rank] < exits[second.local_rank]
    assert second.elapsed - second.timeout >= HELD_GRACE - 0.1  # after the first was gone
    confirmed = [e for e in read_events(event_log) if e.kind == "hang_confirmed"]
    assert [e.get("culprit") for e in confirmed] == [first.local_rank, second.local_rank]


# ---------------------------------------------------------------------- NVRx's loaders
def test_nvrx_config_loaders(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    cfg = FaultToleranceConfig.from_kwargs(safety_factor=3, not_a_field=1, log_level="warn")
    assert cfg.safety_factor == 3 and cfg.log_level == logging.WARNING
    assert "not_a_field" in caplog.text  # ignored, as NVRx does, but named
    with pytest.raises(ConfigError, match="not_a_field"):
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, not_a_field=1)
    # the section at any depth of a whole training config, and a round trip
    whole = tmp_path / "train.yaml"
    whole.write_text(
        "model: {layers: 2}\ntrainer:\n  - x\n  - fault_tolerance:\n      safety_factor: 7\n"
    )
    assert FaultToleranceConfig.from_yaml_file(whole).safety_factor == 7
    out = tmp_path / "out.yaml"
    cfg.to_yaml_file(out)
    assert FaultToleranceConfig.from_yaml_file(out) == cfg
    assert FaultToleranceConfig(log_level=10).log_level == logging.DEBUG


def test_from_args_with_the_launchers_parser(tmp_path: Path):
    from steadfast.launcher.args import get_args_parser

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    parser = get_args_parser()
    args = parser.parse_args(
        ["--ft-cfg-path", str(empty), "--ft-rank-section-timeouts", "step:5,setup:null",
         "--workers-stop-timeout", "7", "train.py"]
    )  # fmt: skip
    cfg = FaultToleranceConfig.from_args(args)  # an empty file plus flags is valid
    assert cfg.rank_section_timeouts == {"step": 5.0, "setup": None}
    assert cfg.workers_stop_timeout == 7
    with pytest.raises(ConfigError, match="no fault tolerance configuration"):
        FaultToleranceConfig.from_args(parser.parse_args(["--ft-cfg-path", str(empty), "t.py"]))
    args = parser.parse_args(["--ignore-missing-fault-tol-cfg", "t.py"])
    assert FaultToleranceConfig.from_args(args) == FaultToleranceConfig()
