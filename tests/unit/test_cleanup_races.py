"""Clean-up that races the rest of the launcher (issue 39, part 4): under load a fence
probe's deadline was started while the roster closed, and a roster that failed to close
left the node's shared memory behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from steadfast.checkpoint.memory import MemoryDir
from steadfast.config import FaultToleranceConfig
from steadfast.launcher.agent import FTAgent
from steadfast.launcher.compile_cache import CompileCache
from steadfast.launcher.job_end import hung_in_teardown
from steadfast.launcher.nodes import NodeRoster, store_calls
from steadfast.launcher.nodes.health import GpuCheck
from steadfast.launcher.nodes.store_calls import Deadlines
from steadfast.launcher.replicas import ReplicaWatch
from steadfast.monitor.table import HeartbeatTable
from steadfast.monitor.watcher import Watcher


class _SlowToStart(threading.Timer):
    """A timer whose thread starts late, as on a machine whose cores are busy."""

    starting = threading.Event()

    def start(self) -> None:
        _SlowToStart.starting.set()
        time.sleep(0.3)
        super().start()


def test_closing_the_deadlines_while_one_starts_neither_raises_nor_leaves_it_running(
    monkeypatch,
):
    monkeypatch.setattr(store_calls.threading, "Timer", _SlowToStart)
    deadlines = Deadlines()
    fired = threading.Event()
    starter = threading.Thread(target=deadlines.start, args=(0.5, fired.set))
    starter.start()
    assert _SlowToStart.starting.wait(5)
    deadlines.close()  # joined a timer not yet started: RuntimeError, before the fix
    starter.join()
    assert not fired.wait(1.0)  # cancelled: it never runs
    late = deadlines.start(0.01, fired.set)  # after close: never runs, no thread
    assert not late.is_alive() and not fired.wait(0.2)


def test_a_deadline_that_closes_its_roster_does_not_join_itself():
    deadlines = Deadlines()
    done = threading.Event()

    def close_from_the_timer() -> None:
        deadlines.close()
        done.set()

    deadlines.start(0.01, close_from_the_timer)
    assert done.wait(5)


def test_the_agent_removes_its_shared_memory_whatever_an_earlier_step_raises(tmp_path: Path):
    """The roster fails to close: the watcher, the heartbeat table and the memory tier's
    directory are gone all the same, and the roster's error is raised after."""
    ft = FaultToleranceConfig()
    agent = object.__new__(FTAgent)  # the parts close() ends, each a real one
    agent.table = HeartbeatTable.create(rows=2)
    agent.memory_dir = MemoryDir()
    agent.compile_cache = CompileCache("job", None)
    agent._gpus = GpuCheck(0)
    agent.template = None
    agent.watcher = Watcher(agent.table, ft)
    agent.watcher.start()
    agent.replicas = ReplicaWatch(ft, agent.table)  # its board's thread
    roster = NodeRoster(ft, host="127.0.0.1")
    agent.roster = roster
    real_close = roster.close

    def failing_close() -> None:
        real_close()
        raise RuntimeError("cannot join thread before it is started")

    roster.close = failing_close  # type: ignore[method-assign]
    table, memory = Path(agent.table.path), Path(agent.memory_dir.path)
    assert table.exists() and memory.exists()
    with pytest.raises(RuntimeError, match="cannot join"):
        agent.close()
    assert not table.exists() and not memory.exists()


def test_a_hang_after_another_node_finished_is_the_jobs_end_not_a_fault_to_restart():
    """A rank found hung once another node of the round finished its workers: every rank
    had passed the job's last collective, so it hung in its teardown (torch 2.13's gloo
    can deadlock there), and a restart would wait for a round the finished node never
    joins. The launcher stops it as hung at the job's end (exit 79) instead."""
    ended = time.monotonic() - 3.0
    ranks, overrun = hung_in_teardown({1: ("no_progress", 0.0)}, ended, lambda r: r + 4)
    assert ranks == [5] and overrun >= 3.0
    assert hung_in_teardown({}, ended, lambda r: r) is None  # no hang: a plain failure
    assert hung_in_teardown({0: ("step", 0.0)}, None, lambda r: r) is None  # no node ended
