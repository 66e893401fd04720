"""The node ledger (steadfast.ledger): which faults count against a node, the entries many
writers publish into one real folder at once (real processes; a reader never sees a
torn entry), a real etcd, the rates `steadfast nodes` prints, the launcher's recorder
fed by the events it emits, and the health check that refuses a node over the
threshold."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_etcd_store import Cluster

from steadfast import events
from steadfast.config import ConfigError, FaultToleranceConfig
from steadfast.launcher.nodes import GpuCheck, health_check
from steadfast.ledger import (
    Entry,
    Fault,
    FileLedger,
    LedgerError,
    Recorder,
    Stint,
    excluded,
    open_ledger,
    refusal,
    tally,
)
from steadfast.ledger.records import fault_of

pytestmark = pytest.mark.timeout(120)

HOUR = 3600.0
NOW = 1.8e9


def ev(kind: str, cause: str | None = None, host: str = "n1", **fields: object) -> dict:
    return {"time": NOW, "kind": kind, "cause": cause, "host": host, **fields}


# ------------------------------------------------------------------ what counts
@pytest.mark.parametrize(
    ("event", "node", "cause"),
    [
        (ev("node_unhealthy", "gpu", reason="device 3: ECC"), "n1", "health_check"),
        (ev("node_lost", "silent", node="n7", how="no beat for 5 s"), "n7", "node_lost"),
        # a node that left on a fault of its own (an exception), saying so: not lost
        (ev("node_lost", "left", node="n7", how="it left the job: its workers FAILED"), None, None),
        # one that failed its check counts once, by its own node_unhealthy; a refusal never
        (ev("node_lost", "unhealthy", node="n7", how="unhealthy (gpu): ECC"), None, None),
        (ev("node_lost", "unhealthy", node="n7", how="unhealthy (ledger): over"), None, None),
        (ev("rank_failed", "signal SIGBUS", rank=3), "n1", "hardware_signal"),
        (ev("node_unhealthy", "ledger", reason="over the threshold"), None, None),
        (ev("rank_failed", "exit 1", rank=3), None, None),  # a Python exception: the script's
        (ev("rank_failed", "signal SIGSEGV", rank=3), None, None),  # cannot be told apart
        (ev("rank_failed", "signal SIGKILL", rank=3), None, None),
        (ev("restart", "worker_failure"), None, None),
    ],
)
def test_only_faults_that_point_at_the_node_count(event, node, cause) -> None:
    fault = fault_of(event, "job1")
    if node is None:
        assert fault is None
    else:
        assert fault is not None and (fault.node, fault.cause, fault.job) == (node, cause, "job1")
        assert fault.evidence


# ------------------------------------------------------------------ the folder
WRITER = """
import os, sys
from steadfast.ledger import Entry, Fault, FileLedger, Stint
root, index, rounds, now = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ledger, host, job = FileLedger(root), f"node{index % 4}", f"job{index}"
entry = Entry(f"{host}--{job}--{os.getpid()}-x", [Stint(host, job, now, now)])
for i in range(rounds):
    entry.stints[0].end = now + (i + 1) * 60
    entry.faults.append(Fault(host, job, now + i, "node_lost", "x" * 2000))
    ledger.publish(entry.writer, entry)
"""


def test_many_writers_at_once_never_tear_an_entry(tmp_path: Path, caplog) -> None:
    """12 processes (launchers of 12 jobs on 4 nodes) replace their entries 30 times
    each (2 KB of evidence a fault, so an entry grows to 60 KB: a write that is not one
    piece would show) while this process reads the folder again and again: every entry
    read is whole, and the last read holds every fault."""
    root = tmp_path / "ledger"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(i), "30", str(NOW)])
        for i in range(12)
    ]
    reads = 0
    with caplog.at_level(logging.WARNING, logger="steadfast.ledger"):
        while any(p.poll() is None for p in procs) or reads == 0:
            for entry in FileLedger(root).entries():
                assert all(len(f.evidence) == 2000 for f in entry.faults)
            reads += 1
    assert [p.wait(60) for p in procs] == [0] * 12
    assert not [r for r in caplog.records if "skipped" in r.getMessage()], "a torn entry"
    records = tally(FileLedger(root).entries(), window=30 * 86400, now=NOW + 3600)
    assert sum(len(r.faults) for r in records) == 12 * 30
    assert {r.node for r in records} == {f"node{i}" for i in range(4)}
    assert all(r.hours == pytest.approx(3 * 30 / 60) for r in records)  # 3 jobs x 30 min
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # none left


def test_an_entry_that_is_not_one_is_named_and_skipped(tmp_path: Path, caplog) -> None:
    good = Entry(
        "w", [Stint("n1", "j", NOW - HOUR, NOW)], [Fault("n1", "j", NOW, "node_lost", "e")]
    )
    ledger = FileLedger(tmp_path)
    ledger.publish("w", good)
    (tmp_path / "broken.json").write_text('{"version": 1, "writer": "x", "stints": [')
    bad_cause = json.loads(good.dumps())
    bad_cause["faults"][0]["cause"] = "python_exception"
    (tmp_path / "cause.json").write_text(json.dumps(bad_cause))
    (tmp_path / "README").write_text("not an entry: not read")
    with caplog.at_level(logging.WARNING, logger="steadfast.ledger"):
        found = list(ledger.entries())
    assert [e.writer for e in found] == ["w"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "broken.json" in said and "not JSON" in said
    assert "cause.json" in said and "faults[0].cause" in said


def test_a_location_that_is_not_one_names_the_problem() -> None:
    with pytest.raises(LedgerError, match="unknown option"):
        open_ledger("etcd://127.0.0.1:2379/ledger?tls=1")
    with pytest.raises(LedgerError, match="no etcd endpoint"):
        open_ledger("etcd:///ledger")
    with pytest.raises(LedgerError, match="cacert"):
        open_ledger("etcds://127.0.0.1:2379/ledger?cacert=/no/such/ca.pem")
    with pytest.raises(ConfigError, match=r"node_ledger_max_faults.*needs a node_ledger"):
        FaultToleranceConfig(node_ledger_max_faults=2)


def test_on_a_real_etcd_each_writer_is_one_key(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, 1)
    try:
        location = f"etcd://{cluster.endpoints()[0]}/site/ledger"
        for i in range(3):
            store = open_ledger(location)
            stint, fault = (
                Stint("n1", f"j{i}", NOW - HOUR, NOW),
                Fault("n1", f"j{i}", NOW - 1, "node_lost", "gone"),
            )
            store.publish(f"w{i}", Entry(f"w{i}", [stint], [fault]))
            store.close()
        store = open_ledger(location)
        found = sorted(e.writer for e in store.entries())
        store.close()
        assert found == ["w0", "w1", "w2"]
        (record,) = tally(open_ledger(location).entries(), 86400, now=NOW)
        assert (record.node, len(record.faults), record.hours) == ("n1", 3, pytest.approx(3.0))
    finally:
        cluster.close()


# ------------------------------------------------------------------ the rates
def test_rates_count_the_window_once_per_fault_and_sort_the_worst_first() -> None:
    entries = [
        Entry("a", [Stint("n1", "j1", NOW - 10 * HOUR, NOW)],
              [Fault("n1", "j1", NOW - HOUR, "node_lost", "x"),
               Fault("n2", "j1", NOW - HOUR, "node_lost", "y")]),
        Entry("b", [Stint("n2", "j1", NOW - 2 * HOUR, NOW - HOUR),
                    Stint("n3", "j2", NOW - 40 * 86400, NOW - 39 * 86400)],
              [Fault("n2", "j1", NOW - HOUR, "node_lost", "y"),  # the same fault again
               Fault("n3", "j2", NOW - 39 * 86400, "health_check", "old")]),
        Entry("c", [], [Fault("n4", "j3", NOW - 5, "hardware_signal", "SIGBUS")]),
    ]  # fmt: skip
    records = tally(entries, window=30 * 86400, now=NOW)
    assert [(r.node, len(r.faults)) for r in records] == [("n4", 1), ("n2", 1), ("n1", 1)]
    n2 = records[1]
    assert n2.hours == pytest.approx(1.0) and n2.rate == pytest.approx(1.0)
    assert records[0].as_json()["rate_per_hour"] is None  # faults, no hours: first
    assert excluded(records, 1) == ["n1", "n2", "n4"] and excluded(records, 0) == []


def test_steadfast_nodes_prints_the_table_and_the_json(tmp_path: Path) -> None:
    ledger = FileLedger(tmp_path / "l")
    now = time.time()
    ledger.publish("w", Entry("w", [Stint("gpu7", "job42", now - 2 * HOUR, now)],
                              [Fault("gpu7", "job42", now - 60, "health_check", "gpu check "
                                     "failed: device 3 ECC")]))  # fmt: skip
    run = [sys.executable, "-m", "steadfast.cli", "nodes", "--ledger", str(tmp_path / "l")]
    table = subprocess.run([*run, "--max-faults", "1"], capture_output=True, text=True, check=True)
    assert "gpu7 *" in table.stdout and "device 3 ECC" in table.stdout
    assert "kept out of jobs" in table.stdout
    out = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True,
                                    check=True).stdout)  # fmt: skip
    (node,) = out["nodes"]
    assert node["node"] == "gpu7" and node["faults"] == 1 and node["jobs"] == ["job42"]
    assert node["rate_per_hour"] == pytest.approx(0.5, rel=0.01)
    assert node["evidence"][0]["cause"] == "health_check"
    bad = subprocess.run([*run, "--window", "soon"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--window" in bad.stderr


# ------------------------------------------------------------------ the recorder
def test_the_launchers_events_become_its_entry(tmp_path: Path, monkeypatch) -> None:
    """What a launcher emits is charged where it points; what is the script's is not.
    A hang counts once the nodes agree it is this node's; a persistent re-run verdict
    at the launcher's end, against the node whose result was doubted."""
    monkeypatch.setenv(events.EVENTS_ENV, str(tmp_path / "events.jsonl"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    host = socket.gethostname()
    ledger = FileLedger(tmp_path / "ledger")
    recorder = Recorder(ledger, host, "job9")
    recorder.start()
    try:
        (entry,) = ledger.entries()  # the stint, published at the start
        assert entry.stints[0].node == host and not entry.faults
        events.emit("node_unhealthy", cause="command", reason="exit 1: disk full")
        events.emit("node_unhealthy", cause="ledger", reason="over the threshold")
        events.emit("rank_failed", cause="exit 1", rank=0, local_rank=0, exit_code=1)
        events.emit("rank_failed", cause="signal SIGBUS", rank=1, local_rank=1, exit_code=-7)
        events.emit("node_lost", cause="silent", node="peer3", how="no beat for 5 s")
        gil = "no answer (its main thread holds the GIL)"
        events.emit("hang_confirmed", cause="no_progress", culprit=1, where=gil, summary="s")
        events.emit("fault_culprit", what="rank hung", node="peer3", fault_id="f1")  # not ours
        events.emit("hang_confirmed", cause="no_progress", culprit=1, where="stopped (state T)")
        events.emit("fault_culprit", what="rank hung", node=host, fault_id="f2")  # T: the user's
        events.emit("hang_confirmed", cause="no_progress", culprit=0, where=f"{gil}", summary="t")
        events.emit("fault_culprit", what="rank hung", node=host, fault_id="f3")  # ours
        events.emit("rerun_elsewhere", cause="reproduced", hardware="gpu0", rank=0)
        events.emit("rerun_verdict", cause="persistent", verdict="persistent", rank=0)
        (entry,) = ledger.entries()  # published at each fault
        assert len(entry.faults) == 4
    finally:
        recorder.close()
    (entry,) = ledger.entries()
    got = sorted((f.node, f.cause) for f in entry.faults)
    assert got == sorted([(host, "health_check"), (host, "hardware_signal"),
                          ("peer3", "node_lost"), (host, "hang_outside_code"),
                          (host, "rerun_persistent")])  # fmt: skip
    assert entry.stints[0].end >= entry.stints[0].start
    assert recorder.observe not in events.writer.record_listeners


def test_an_unwritable_ledger_is_said_once_and_the_job_goes_on(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    recorder = Recorder(FileLedger(blocker / "ledger"), "n1", "j")
    with caplog.at_level(logging.WARNING):
        recorder.start()
        recorder.observe(ev("node_lost", "silent", node="n2", how="h"))
        recorder.close()
    said = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(said) == 1 and "goes on" in said[0].getMessage()


# ------------------------------------------------------------------ the refusal
def test_a_node_over_the_threshold_fails_its_health_check(tmp_path: Path) -> None:
    host = socket.gethostname()
    ledger = FileLedger(tmp_path)
    now = time.time()
    faults = [Fault(host, f"job{i}", now - 100 * i, "health_check", f"try {i}") for i in (1, 2)]
    ledger.publish("w", Entry("w", [Stint(host, "job1", now - HOUR, now)], faults))
    ft = FaultToleranceConfig(node_ledger=str(tmp_path), node_ledger_max_faults=2)
    check = health_check(ft, GpuCheck(0))
    assert check is not None and check[0] == "ledger"
    assert "2 faults" in check[1] and "node_ledger_max_faults=2" in check[1]
    ft3 = FaultToleranceConfig(node_ledger=str(tmp_path), node_ledger_max_faults=3)
    assert health_check(ft3, GpuCheck(0)) is None
    old = FaultToleranceConfig(node_ledger=str(tmp_path), node_ledger_max_faults=2,
                               node_ledger_window_days=0.001)  # fmt: skip
    assert health_check(old, GpuCheck(0)) is None  # the faults are older than the window
    assert refusal(str(tmp_path), 2, 30, host="elsewhere") is None
