"""Learned hang timeouts (monitor/learned.py): what a rank's client records in its row of
a real heartbeat table, the timeouts the watcher then applies, and what the launcher keeps
across restarts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from steadfast.config import FaultToleranceConfig
from steadfast.monitor import FT_CONFIG_ENV, HB_TABLE_ENV, HeartbeatTable, RankMonitorClient
from steadfast.monitor.learned import Learned, effective, learn_bits, learned_timeout
from steadfast.monitor.table import LEARN_HB, LEARN_OOS, LEARN_SECTIONS
from steadfast.monitor.watcher import next_deadline

CFG = FaultToleranceConfig()


@pytest.fixture
def row(monkeypatch: pytest.MonkeyPatch):
    tab = HeartbeatTable.create(rows=1)
    tab.reset(0, {}, 3600.0, 2700.0, None, learn=learn_bits(CFG))
    monkeypatch.setenv(HB_TABLE_ENV, str(tab.path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(FT_CONFIG_ENV, json.dumps({}))
    yield tab
    tab.close()


class _Clock:
    """time.monotonic, moved by hand (the client reads it for every interval)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("steadfast.monitor.client.time.monotonic", lambda: self.now)


def test_nothing_is_learned_until_ready_then_3x_the_longest_not_below_the_floor(row, monkeypatch):
    clock = _Clock(monkeypatch)
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    for i in range(12):  # heartbeats 0.2 s apart, one of 2 s; the first interval: warm-up
        clock.now += 30.0 if i == 1 else (2.0 if i == 6 else 0.2)
        ft.send_heartbeat()
    snap, learned = effective(row.snapshot(0), CFG)
    assert snap.learned_heartbeat == (2.0, 10)  # the 30 s warm-up interval left out
    assert learned == {"heartbeat"} and snap.heartbeat_timeout == 6.0  # 3 x 2 s
    # a section: its own runs, the step's timeout on the floor; the heartbeat's is not in
    # force while a section is open (the section's own covers it)
    for _ in range(9):
        ft.start_section("step")
        clock.now += 0.1
        ft.end_section("step")
        clock.now += 0.01
    ft.start_section("step")
    snap, learned = effective(row.snapshot(0), CFG)
    assert snap.section_timeouts["step"] == 5.0 and "section:step" in learned
    assert snap.heartbeat_timeout == 2700.0 and "heartbeat" not in learned
    assert next_deadline(snap, 0.0, 0)[1] == "section:step"
    # a section seen fewer than 8 times keeps the default
    ft.end_section("step")
    ft.start_section("checkpointing")
    snap, learned = effective(row.snapshot(0), CFG)
    assert snap.section_timeouts["checkpointing"] == math.inf and learned >= {"out_of_section"}
    ft.end_section("checkpointing")
    # right after a section closed, the interval since the last heartbeat is the
    # section's, timed by it: the heartbeat's learned timeout waits for a heartbeat
    clock.now += 60.0
    snap, learned = effective(row.snapshot(0), CFG)
    assert "heartbeat" not in learned and snap.heartbeat_timeout == 2700.0
    ft.send_heartbeat()
    assert "heartbeat" in effective(row.snapshot(0), CFG)[1]
    ft.shutdown_workload_monitoring()


def test_a_timeout_the_user_set_or_calculated_is_not_learned(row, monkeypatch):
    assert learn_bits(FaultToleranceConfig(learn_timeouts=False)) == 0
    assert not learn_bits(FaultToleranceConfig(rank_heartbeat_timeout=None)) & LEARN_HB
    assert learn_bits(FaultToleranceConfig(rank_heartbeat_timeout=30.0)) == (
        LEARN_SECTIONS | LEARN_OOS
    )
    assert learn_bits(CFG) == LEARN_SECTIONS | LEARN_OOS | LEARN_HB
    row.reset(0, {"step": 30.0}, 3600.0, 2700.0, None, learn=learn_bits(CFG))
    clock = _Clock(monkeypatch)
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    for _ in range(12):
        ft.start_section("step")
        clock.now += 0.1
        ft.end_section("step")
        clock.now += 0.1
        ft.send_heartbeat()
    ft.start_section("step")
    snap, learned = effective(row.snapshot(0), CFG)
    assert snap.section_timeouts["step"] == 30.0 and "section:step" not in learned
    ft.end_section("step")
    for _ in range(12):  # heartbeats alone now: learned...
        clock.now += 0.2
        ft.send_heartbeat()
    assert "heartbeat" in effective(row.snapshot(0), CFG)[1]
    ft.calculate_and_set_hb_timeouts()  # ...until the user calculates one (NVRx's API)
    snap, learned = effective(row.snapshot(0), CFG)
    assert "heartbeat" not in learned and snap.heartbeat_timeout == pytest.approx(1.0)  # 5 x 0.2
    ft.shutdown_workload_monitoring()


def test_the_rule_never_above_the_default():
    assert learned_timeout(0.2, 7, CFG, 2700.0) is None
    assert learned_timeout(0.2, 8, CFG, 2700.0) == 5.0
    assert learned_timeout(10.0, 8, CFG, 2700.0) == 30.0
    assert learned_timeout(2000.0, 8, CFG, 2700.0) == 2700.0
    assert learned_timeout(2000.0, 8, CFG, math.inf) == 6000.0


def test_a_slow_drift_is_followed_a_sudden_3x_step_is_not():
    """Steps from 1 s to 3 s over 100 steps: each step is under the timeout learned
    from the ones before it; a step 3x the longest seen is over it."""
    longest, count = 0.0, 0
    for i in range(100):
        step = 1.0 + 2.0 * i / 100
        timeout = learned_timeout(longest, count, CFG, 2700.0)
        assert timeout is None or step < timeout
        longest, count = max(longest, step), count + 1
    assert 3.1 * longest > learned_timeout(longest, count, CFG, 2700.0)


def test_a_restarted_process_runs_each_kind_once_under_the_default(row, monkeypatch):
    """What earlier generations learned is preloaded (ready), but a new process warms up
    again (compilation, caches): its first step runs under the default, the next under
    the learned timeout."""
    row.reset(0, {}, 3600.0, 2700.0, None, learn=7, learned={"section:step": (0.25, 40)})
    clock = _Clock(monkeypatch)
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    ft.start_section("step")
    clock.now += 60.0  # a first step that compiles
    snap, learned = effective(row.snapshot(0), CFG)
    assert snap.section_timeouts["step"] == math.inf and not learned
    ft.end_section("step")
    ft.start_section("step")
    snap, learned = effective(row.snapshot(0), CFG)
    assert snap.section_timeouts["step"] == 5.0 and learned == {"section:step"}
    assert snap.learned_sections["step"] == (0.25, 40)  # the warm-up is not learned
    ft.end_section("step")
    ft.shutdown_workload_monitoring()


def test_the_launcher_keeps_what_was_learned_across_restarts(row, tmp_path: Path):
    path = tmp_path / "learned_timeouts.json"
    row.reset(
        0, {}, 3600.0, 2700.0, None, learn=7,
        learned={"heartbeat": (0.3, 20), "section:step": (0.25, 40)},
    )  # fmt: skip
    snap = row.snapshot(0)
    assert snap.learned_heartbeat == (0.3, 20) and snap.learned_sections == {"step": (0.25, 40)}
    kept = Learned(path, "job-7")
    kept.merge(snap)
    kept.overran("section:step", 5.5)  # a hang caught by it: back on the default until
    kept.save()  # seen 8 times again, and at least that long from then on
    again = Learned(path, "job-7")
    assert again.kinds == {"heartbeat": (0.3, 20), "section:step": (5.5, 0)}
    assert Learned(path, "another-job").kinds == {}  # another run's: not used
    path.write_text('{"run_id": "job-7", "kinds": {"heartbeat": {"longest": "x"}}}')
    assert Learned(path, "job-7").kinds == {}  # a bad file: a warning, learning anew
