"""The node roster and the checkpoint fence on one host: real rosters (each its beacon,
its ring watch and its fence socket) entering a round over a real TCPStore, a peer that
closes or goes silent, a store that dies; the fence as the ranks see it."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sfharness import enter_round as enter
from sfharness import read_events, refusing_fence, wait_for
from steadfast import CheckpointFenced, CheckpointManager
from steadfast.config import ConfigError, FaultToleranceConfig
from steadfast.fence import FENCE_ENV, FENCE_TIMEOUT_ENV, check
from steadfast.launcher.nodes import NodeRoster

# a timeout well above a loaded 2-core machine's scheduling hiccups: a roster starved
# for longer than it would be reported silent
FT = FaultToleranceConfig(node_heartbeat_interval=0.05, node_heartbeat_timeout=2.0)


STORE_SERVER = (
    "import time, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def server() -> Iterator[subprocess.Popen[str]]:
    """The rendezvous store, in a process of its own (as on the rendezvous host)."""
    proc = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.port = int(proc.stdout.readline())  # type: ignore[attr-defined]
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()


def client(server: subprocess.Popen[str], prefix: str | None = "round1") -> dist.Store:
    """One launcher's connection to the store, under the round's prefix: its calls time
    out after 1 s (the tests' bounds); its connection may take longer on a busy machine,
    where the store's process waits for a core as a real store host's would."""
    conn = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=_td(30))  # type: ignore[attr-defined]
    conn.set_timeout(_td(1))
    return dist.PrefixStore(prefix, conn) if prefix else conn


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


@pytest.fixture
def rosters(server) -> Iterator[list[NodeRoster]]:
    # reached at an address, named by a host name (the one every event of it carries)
    made: list[NodeRoster] = []
    try:  # the rosters made are closed however the setup ends
        for i in range(3):
            made.append(NodeRoster(FT, host=f"127.0.0.{i + 1}", name=f"node{i + 1}"))
        enter(made, [client(server) for _ in made])
        yield made
    finally:
        for r in made:
            r.close()


def kinds(path: Path, kind: str) -> list[dict]:
    return [e for e in read_events(path) if e["kind"] == kind]


def test_a_node_whose_launcher_closes_is_lost_once_and_every_watcher_knows(rosters, event_log):
    a, b, c = rosters
    b.close()  # its sockets close without a goodbye: a launcher that died
    wait_for(lambda: bool(a.losses()) and bool(c.losses()), timeout=10, what="the loss")
    assert [loss.peer.rank for loss in a.losses()] == [1]
    assert a.losses()[0].cause == "connection_reset"
    wait_for(lambda: bool(kinds(event_log, "node_lost")), timeout=10, what="node_lost")
    time.sleep(0.3)
    lost = kinds(event_log, "node_lost")
    assert len(lost) == 1, lost  # two watchers saw it; the first to confirm reports
    assert lost[0]["node"] == "node2" and lost[0]["node_rank"] == 1  # its name, not address
    assert lost[0]["cause"] == "connection_reset" and lost[0]["nodes"] == 3


def test_a_node_whose_workers_finished_leaves_without_being_lost(rosters, event_log):
    a, b, c = rosters
    b.finish()
    time.sleep(0.2)
    b.close()
    time.sleep(FT.node_heartbeat_timeout + 0.5)  # past a silence, too
    assert not a.losses() and not c.losses()
    assert not kinds(event_log, "node_lost")


def test_a_silent_node_is_lost_after_the_heartbeat_timeout(server, event_log):
    """A peer whose beacon accepts and then says nothing (its link or power went)."""
    mute = socket.create_server(("127.0.0.1", 0))
    peer = {"rank": 1, "host": "mute", "addr": "127.0.0.1", "port": mute.getsockname()[1]}
    try:
        s = client(server)
        s.set("steadfast/node/1", json.dumps({**peer, "pid": 1, "rdzv": None}))
        roster = NodeRoster(FT, host="127.0.0.1")
        try:
            started = time.monotonic()
            roster.enter_round(s, 0, 2, "job", None)
            conn, _ = mute.accept()
            wait_for(lambda: bool(roster.losses()), timeout=10, what="the silent node")
            assert time.monotonic() - started >= FT.node_heartbeat_timeout
            conn.close()
        finally:
            roster.close()
    finally:
        mute.close()
    (lost,) = kinds(event_log, "node_lost")
    assert lost["cause"] == "silent" and lost["node"] == "mute"
    assert lost["latency"] >= FT.node_heartbeat_timeout


def test_the_fence_lets_the_current_round_write_and_no_one_else(server, rosters, monkeypatch):
    a, b, _ = rosters
    monkeypatch.setenv(FENCE_TIMEOUT_ENV, "3")
    monkeypatch.setenv(FENCE_ENV, a.env()[FENCE_ENV])
    assert check() is None
    # the job formed a newer round without these nodes (a spare took their place)
    job = client(server, prefix=None)
    record = json.loads(job.get("steadfast/job/round"))
    job.set("steadfast/job/round", json.dumps({**record, "token": uuid.uuid4().hex}))
    del job
    time.sleep(0.6)  # past the reuse of the last answer
    assert "newer round" in (check() or "")
    b.leave_round()
    monkeypatch.setenv(FENCE_ENV, b.env()[FENCE_ENV])
    assert "not in a running round" in (check() or "")
    monkeypatch.setenv(FENCE_ENV, "@steadfast-fence-nobody")
    assert "did not answer" in (check(timeout=1) or "")


def test_a_node_that_loses_its_peer_and_the_store_is_isolated_and_fenced(
    server, event_log, monkeypatch
):
    """The store (another process) dies with a peer: the launcher that sees the loss
    cannot confirm it, so it is the one cut off: node_isolated, and its ranks fenced."""
    a, b = rosters = [NodeRoster(FT, host=f"127.0.0.{i + 1}") for i in range(2)]
    try:
        enter(rosters, [client(server, prefix="r") for _ in rosters])
        monkeypatch.setenv(FENCE_ENV, a.env()[FENCE_ENV])
        assert check(timeout=3) is None
        server.kill()
        server.wait()
        b.close()
        wait_for(lambda: a.isolated() is not None, timeout=10, what="isolation")
        assert "cannot reach the rendezvous store" in (a.isolated() or "")
        (isolated,) = kinds(event_log, "node_isolated")
        assert isolated["cause"] == "partition"
        assert not kinds(event_log, "node_lost")
        assert check(timeout=3)  # fenced
    finally:
        for r in rosters:
            r.close()


def test_a_fenced_rank_writes_no_checkpoint(tmp_path, monkeypatch, event_log):
    """CheckpointManager asks the fence before it writes anything: a fenced rank raises
    CheckpointFenced and leaves the directory as it was."""
    with refusing_fence("fenced: the job formed a newer round without this node") as where:
        monkeypatch.setenv(FENCE_ENV, where)
        ckpt = CheckpointManager(tmp_path / "ck")
        try:
            with pytest.raises(CheckpointFenced, match="newer round"):
                ckpt.save(2, {"model": torch.nn.Linear(2, 2)})
        finally:
            ckpt.close()
    assert not list((tmp_path / "ck").rglob("*")), "a fenced rank wrote to the directory"
    (fenced,) = kinds(event_log, "checkpoint_fenced")
    assert "step_2" in fenced["path"] and "newer round" in fenced["reason"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"node_heartbeat_interval": 0.0}, "node_heartbeat_interval"),
        ({"node_heartbeat_interval": 1.0, "node_heartbeat_timeout": 0.5}, "node_heartbeat_timeout"),
        ({"node_lost_timeout": -1}, "node_lost_timeout"),
        ({"node_health_check": "  "}, "node_health_check"),
        ({"node_min_free_gb": -2}, "node_min_free_gb"),
    ],
)
def test_bad_node_settings_name_the_field(fields, named):
    with pytest.raises(ConfigError, match=named):
        FaultToleranceConfig(**fields)


def test_a_node_that_leaves_on_a_fault_of_its_own_is_reported_with_its_reason(rosters, event_log):
    """A launcher stopping on exit 17 (say) is not a silent loss: it records why it left
    (cause ``left``) and its watchers report that, once, and go on without it."""
    a, b, c = rosters
    b.leave_round(reason="its launcher stopped (RerunExit: 17)", cause="left")
    wait_for(lambda: bool(kinds(event_log, "node_lost")), timeout=10, what="node_lost")
    wait_for(lambda: bool(a.losses()) and bool(c.losses()), timeout=10, what="both watchers")
    time.sleep(0.3)
    (lost,) = kinds(event_log, "node_lost")
    assert lost["cause"] == "left" and "RerunExit: 17" in lost["how"]
    assert lost["node"] == "node2"


def test_the_others_finding_this_node_lost_cuts_it_off(server, rosters, monkeypatch):
    """A node the others confirmed lost (it cannot see its peers but still reaches the
    store) learns it, stops counting itself in, and its ranks are fenced."""
    a, b, _ = rosters
    monkeypatch.setenv(FENCE_ENV, b.env()[FENCE_ENV])
    assert check(timeout=3) is None
    round1 = client(server)
    round1.set("steadfast/lost_how/1", "silent:no beat for 2.0 s")
    round1.add("steadfast/lost/1", 1)
    round1.add("steadfast/lost_count", 1)
    round1.set("steadfast/lost_seq/1", "1")  # as claim_loss records it
    del round1
    time.sleep(0.6)  # past the reuse of the last answer
    assert "found this node lost" in (check(timeout=3) or "")
    b.wait_for_loss(2)
    assert "found this node lost" in (b.isolated() or "")
    assert not b.losses()  # it does not blame anyone else
    assert [loss.peer.rank for loss in a.wait_for_loss(2)] == [1]


def test_every_rank_asking_at_once_gets_the_one_probe_answer(rosters, monkeypatch):
    """A save asks the fence from every rank at the same moment: one probe answers all."""
    a = rosters[0]
    monkeypatch.setenv(FENCE_ENV, a.env()[FENCE_ENV])
    answers: list[str | None] = []
    askers = [threading.Thread(target=lambda: answers.append(check(timeout=5))) for _ in range(8)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(10)
    assert answers == [None] * 8


def test_rounds_that_share_one_store_are_kept_apart(server, event_log):
    """Torch's static rendezvous gives every round the same store: the round's number
    keeps the second round's token, nodes and losses apart from the first's."""
    for generation in (1, 2):
        made = [NodeRoster(FT, host=f"127.0.0.{i + 1}") for i in range(2)]
        stores = [client(server, prefix="static") for _ in made]
        try:
            threads = [
                threading.Thread(
                    target=r.enter_round,
                    args=(s, i, 2, "job", None),
                    kwargs={"generation": generation},
                )
                for i, (r, s) in enumerate(zip(made, stores, strict=True))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            tokens = {r._round.token for r in made if r._round is not None}
            assert len(tokens) == 1  # both hold this round's token, not the last one's
            if generation == 1:
                made[1].close()  # a loss in round 1 ...
                wait_for(lambda r=made[0]: bool(r.losses()), timeout=10, what="the loss")
            else:
                assert not made[0].wait_for_loss(0.5)  # ... is not round 2's
        finally:
            for r in made:
                r.close()
            del stores


def test_the_exit_barrier_stops_waiting_for_a_node_another_launcher_found_lost(
    server, event_log, caplog
):
    """Four nodes; node4 dies while the others finish. node1 does not watch node4 (the
    ring watches the next two): it learns the loss from the store, where node2 or node3
    confirmed it, and leaves the barrier without waiting out its timeout."""
    made = [NodeRoster(FT, host=f"127.0.0.{i + 1}", name=f"node{i + 1}") for i in range(4)]
    try:
        enter(made, [client(server) for _ in made])
        made[3].close()  # its sockets close without a goodbye: a launcher that died
        results: dict[int, tuple[list[str], list[str]]] = {}

        def finish(i: int) -> None:
            results[i] = made[i].exit_barrier(timeout=60)

        others = [threading.Thread(target=finish, args=(i,)) for i in (1, 2)]
        for t in others:
            t.start()
        with caplog.at_level(logging.INFO, logger="steadfast"):
            finish(0)
        for t in others:
            t.join(60)
        # none missing, node4 lost: left for the loss, not the timeout
        assert results == {i: ([], ["node4"]) for i in range(3)}
        assert "leaving without them" not in caplog.text
        # the confirming launcher reports the loss once its store write is answered: the
        # barrier may read the write first
        wait_for(lambda: bool(kinds(event_log, "node_lost")), timeout=10, what="node_lost")
        (lost,) = kinds(event_log, "node_lost")
        assert lost["node"] == "node4"
    finally:
        for r in made:
            r.close()


def test_a_watcher_that_connects_after_this_node_left_sees_it_go():
    """A node that leaves the job right after a round formed may not have accepted every
    watcher's connection yet (it waits in the listen backlog): that watcher must see it go
    too, not get beats from a node that left (seen in CI under load: one of the two
    watchers never reported the loss). Once in a round again, it is watched as before."""
    import socket

    from steadfast.launcher.nodes.ring import Ring

    ring = Ring(0.05, 1.0, lambda *_: None)
    ring.start()
    try:
        ring.release([], watchers=True)  # this node left
        late = socket.create_connection(("127.0.0.1", ring.port), timeout=5)
        late.settimeout(5)
        assert late.recv(1) == b""  # closed at once: no beat from a node that left
        late.close()
        ring.admit()  # in a round again
        watcher = socket.create_connection(("127.0.0.1", ring.port), timeout=5)
        watcher.settimeout(5)
        assert watcher.recv(1) == b"\x01"  # a beat
        watcher.close()
    finally:
        ring.stop()
        ring.close()


def _finish_all(made: list[NodeRoster], which: list[int], timeout: float) -> dict[int, object]:
    """The launchers ``which`` finish their workers at once (the goodbye, then the exit
    barrier, as the agent does); each one's barrier result."""
    results: dict[int, object] = {}

    def finish(i: int) -> None:
        made[i].finish()
        results[i] = made[i].exit_barrier(timeout=timeout)

    threads = [threading.Thread(target=finish, args=(i,)) for i in which]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


def test_a_launcher_with_another_view_of_the_barriers_keys_keeps_no_one_waiting(rosters, caplog):
    """node3 holds another view of the round (its barrier's keys under another prefix, as
    a node with another round or rank than the others think): it never marks the key the
    others read, nor reads theirs. Every node finished, each heard the others' goodbyes
    over the ring, and every barrier ends at once, not at its timeout (issue 36: the
    survivors waited for the spare that had finished)."""
    from steadfast.launcher.nodes.round import RoundKeys

    rosters[2]._round.keys = RoundKeys("another view", generation=7)
    with caplog.at_level(logging.INFO, logger="steadfast"):
        results = _finish_all(rosters, [0, 1, 2], timeout=60)
    assert results == {i: ([], []) for i in range(3)}
    assert "leaving without them" not in caplog.text


def test_the_exit_barrier_leaves_at_its_bound_naming_a_node_that_never_finishes(rosters, caplog):
    """node3's workers never end (stuck in their teardown, say): node1 and node2 wait in
    the exit barrier up to its bound, then leave naming node3; node3 heard them finish
    (the job's end as the agent reads it, to take its workers for hung)."""
    assert rosters[2].job_ended_at() is None
    with caplog.at_level(logging.INFO, logger="steadfast"):
        results = _finish_all(rosters, [0, 1], timeout=1.0)
    assert results == {0: (["node3"], []), 1: (["node3"], [])}
    assert "did not hear node3 finish within 1 s" in caplog.text
    ended = rosters[2].job_ended_at()
    assert ended is not None and ended <= time.monotonic()


def test_the_barrier_waits_for_the_mark_of_a_node_it_heard_finish(rosters, monkeypatch):
    """A node says goodbye over the ring, then marks its exit in the store: the store's
    host waits for that mark (up to MARK_GRACE) before it leaves and closes the store,
    and each barrier ends all_finished."""
    from steadfast.launcher.nodes import exit_barrier

    monkeypatch.setattr(exit_barrier, "MARK_GRACE", 60.0)  # a loaded machine's delays
    node1, node2, node3 = rosters
    node2.finish()
    node3.finish()
    wait_for(lambda: {1, 2} <= set(node1._finished), timeout=10, what="both goodbyes")
    marking: dict[int, float] = {}
    results: dict[int, object] = {}

    def late(i: int) -> None:
        time.sleep(0.5)
        marking[i] = time.monotonic()
        results[i] = rosters[i].exit_barrier(timeout=60)

    threads = [threading.Thread(target=late, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    results[0] = node1.exit_barrier(timeout=60)
    left = time.monotonic()
    for t in threads:
        t.join(60)
    assert left >= max(marking.values())  # not before the last mark could be made
    assert results == {i: ([], []) for i in range(3)}
