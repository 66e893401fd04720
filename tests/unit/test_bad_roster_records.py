"""Bad input never steers the job (issue 39, part 3), for the node roster's records and
the event log: hypothesis throws at their readers what a broken or hostile peer could
write (truncated records, wrong types, oversized values, records of another round), and
checks that each is refused with a clear error or ignored. For the roster it does so on
a real TCPStore, through the calls that act on the records: no call raises, no healthy
node is taken for lost or cut off, and each refused record is said once
(``record_refused``).

With the job's secret (the store bound to it, as under any rendezvous), the same
garbage is written at the sealed keys (a peer that read the prefix off the store): none
of it opens, none is acted on, and not even a well-formed claim counts.

The cases tried are each test's ``max_examples``: 1,000 records for each parser, 1,000
event lines, 40 rounds of garbage on a real store, without a secret and with one."""

from __future__ import annotations

import datetime
import gc
import json
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from steadfast.events import EventLogError, parse_event, read_events
from steadfast.launcher.nodes.confirm import claim_loss, recorded_losses
from steadfast.launcher.nodes.culprit import Claim, agree
from steadfast.launcher.nodes.records import (
    parse_hosts,
    parse_leaving,
    parse_loss,
    parse_peer,
    parse_rank,
    parse_round,
    parse_verdict,
)
from steadfast.launcher.nodes.round import (
    Peer,
    PeerBook,
    Round,
    RoundKeys,
    own_connection,
    round_token,
)
from steadfast.records import MalformedRecord
from steadfast.rendezvous.signed import SignedStore

pytestmark = pytest.mark.timeout(600)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
PEER = {"rank": 1, "host": "n1", "addr": "10.0.0.2", "port": 29400, "pid": 4242, "rdzv": None}
CLAIM = {"what": "rank failed", "node": "n1", "node_rank": 1, "rank": 3,
         "cause": "signal SIGKILL", "time": 1.7e9, "detected": 1.7e9, "weight": 1}  # fmt: skip
GOOD = {
    "peer": json.dumps(PEER),
    "round": json.dumps({"token": uuid.uuid4().hex}),
    "hosts": json.dumps(["n0", "n1"]),
    "leaving": json.dumps({"cause": "unhealthy", "reason": "gpu check failed"}),
    "verdict": json.dumps({"claim": CLAIM, "claims": 2}),
}


@st.composite
def broken(draw: st.DrawFn, good: str) -> bytes:
    """A real record, then broken: cut short, a field retyped, oversized, anything."""
    how = draw(st.sampled_from(["truncate", "retype", "oversize", "any", "bytes"]))
    if how == "truncate":
        return good[: draw(st.integers(0, len(good) - 1))].encode()
    if how == "any":
        return json.dumps(draw(json_values)).encode()
    if how == "bytes":
        return draw(st.binary(max_size=200))
    try:
        record = json.loads(good)
    except ValueError:  # a record in plain text
        record = None
    if not isinstance(record, (dict, list)):
        return (good + "x" * draw(st.integers(4097, 50_000))).encode()
    inner = record["claim"] if "claim" in record and draw(st.booleans()) else record
    if isinstance(inner, list):
        inner[draw(st.integers(0, len(inner) - 1))] = (
            draw(json_values) if how == "retype" else "x" * draw(st.integers(4097, 50_000))
        )
    else:
        field = draw(st.sampled_from(sorted(inner)))
        inner[field] = (
            draw(json_values) if how == "retype" else "x" * draw(st.integers(4097, 50_000))
        )
    return json.dumps(record).encode()


def _refused_or(parse, raw):
    try:
        return parse(raw)
    except MalformedRecord as exc:
        assert str(exc)  # one readable error
        return None


@settings(max_examples=1000, deadline=None)
@given(broken(GOOD["peer"]))
def test_a_nodes_record_is_its_launchers_or_refused(raw: bytes) -> None:
    fields = _refused_or(lambda r: parse_peer(r, 1), raw)
    if fields is not None:
        peer = Peer(**fields)
        assert peer.rank == 1 and peer.host and 0 < peer.port <= 65535 and peer.reachable


@settings(max_examples=1000, deadline=None)
@given(broken(GOOD["verdict"]))
def test_a_culprit_verdict_is_a_nodes_or_refused(raw: bytes) -> None:
    found = _refused_or(parse_verdict, raw)
    if found is not None and found[0] is not None:  # None: a verdict naming no culprit
        claim = Claim(**found[0])
        assert claim.beats(claim) is False and found[1] >= 0  # comparable, never raises


@settings(max_examples=1000, deadline=None)
@given(
    st.sampled_from(["round", "hosts", "leaving"]).flatmap(
        lambda what: st.tuples(st.just(what), broken(GOOD[what]))
    )
)
def test_a_rounds_token_hosts_and_reasons_are_a_nodes_or_refused(case) -> None:
    what, raw = case
    parse = {"round": parse_round, "hosts": parse_hosts, "leaving": parse_leaving}[what]
    found = _refused_or(parse, raw)
    if what == "round" and found is not None:
        assert len(found) == 32 and int(found, 16) >= 0
    if what == "hosts" and found is not None:
        assert all(isinstance(h, str) and 0 < len(h) <= 4096 for h in found)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=100) | st.text(max_size=6000).map(str.encode), st.integers(1, 64))
def test_a_loss_and_its_place_are_a_nodes_or_refused(raw: bytes, nodes: int) -> None:
    loss = _refused_or(parse_loss, raw)
    if loss is not None:
        assert loss[0] and len(loss[0]) <= 64
    rank = _refused_or(lambda r: parse_rank(r, nodes), raw)
    assert rank is None or 0 <= rank < nodes


# ------------------------------------------------------------------ on a real store
def _server() -> dist.TCPStore:  # type: ignore[name-defined]
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True
    )


def _client(server):
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


def _round(client, rank: int, token: str, keys: RoundKeys) -> Round:
    return Round(
        client, client, rank, 3, PeerBook(client, keys, {}), token, keys, own_connection(client)
    )


def _records(keys: RoundKeys) -> dict[str, str]:
    """The roster's keys a peer may write, and a real record of each."""
    return {
        keys.node(1): GOOD["peer"],
        keys.record: GOOD["round"],
        keys.left(1): GOOD["leaving"],
        keys.lost_how(1): "silent:no beat for 2.0 s",
        keys.lost_seq(1): "1",
        keys.fault_claim: json.dumps(CLAIM),
    }


def _well_formed(raw: bytes | None) -> bool:
    if raw is None:
        return False
    try:
        Claim.loads(raw)
    except MalformedRecord:
        return False
    return True


KEYS = RoundKeys("job")
GARBAGE_AT = _records(KEYS)
ROUNDS = 40


SECRET = b"k" * 32


@pytest.mark.parametrize("signed", [False, True], ids=["no-secret", "secret"])
def test_garbage_in_a_rounds_store_is_refused_and_changes_nothing(
    event_log: Path, signed: bool
) -> None:
    """A peer writes broken records at the roster's keys of a running round of 3 nodes
    (each of the 40 rounds on keys of its own, on one real store). The calls that read
    them do not raise; the round stays the job's (no node is taken for replaced), only
    the ranks of the round are lost, a refused node's record gives a stand-in that is
    never watched, a culprit is a real claim or none, and each refused record is said
    once. With a secret, what the nodes write is sealed and the garbage lands at the
    sealed keys."""
    made = [_server()]
    clients = [_client(made[0]) for _ in range(3)]
    if signed:
        clients = [SignedStore(c, SECRET, "job") for c in clients]
    tried: list[dict[str, bytes]] = []

    @settings(max_examples=ROUNDS, deadline=None)
    @example(garbage={KEYS.fault_claim: json.dumps({**CLAIM, "node_rank": None}).encode()})
    @example(garbage={KEYS.fault_claim: b"\x80", KEYS.record: b'{"token": 1}'})
    @example(garbage={KEYS.lost_seq(1): b"0", KEYS.lost_how(1): b"\xff"})
    @given(
        garbage=st.dictionaries(
            st.sampled_from(sorted(GARBAGE_AT)),
            st.one_of(*(broken(good) for good in GARBAGE_AT.values())),
            min_size=1,
        )
    )
    def one_round(garbage: dict[str, bytes]) -> None:
        tried.append(garbage)
        raw_store = made[0]
        # what the nodes write (sealed, with a secret); where a peer writes raw bytes
        server = SignedStore(raw_store, SECRET, "job") if signed else raw_store

        def at(key: str) -> str:  # where a peer that read the job's prefix writes
            return server.prefix + key if signed else key

        keys = RoundKeys(f"job{len(tried)}", len(tried))  # a round of its own
        real = _records(keys)
        token = uuid.uuid4().hex
        event_log.write_text("")
        for r in range(3):  # every node of the round published itself
            server.set(keys.node(r), json.dumps({**PEER, "rank": r, "host": f"n{r}"}))
        server.set(keys.record, json.dumps({"token": token}))
        server.set(keys.lost_how(1), real[keys.lost_how(1)])
        server.add(keys.lost(1), 1)
        server.add(keys.lost_count, 2)  # one real loss, one place a peer writes
        server.set(keys.lost_seq(1), "1")
        here = dict(zip(GARBAGE_AT, real, strict=True))  # the same key in this round
        for key, raw in garbage.items():
            raw_store.set(at(here[key]), raw)
        rounds = [_round(c, r, token, keys) for r, c in enumerate(clients)]
        me = rounds[0]
        peer = me.peers[1]
        assert peer.rank == 1 and (peer.reachable or peer.host == "node rank 1")
        assert me.job_token() == token
        losses = recorded_losses(me)
        assert {r for r, _ in losses} <= {0, 1, 2}  # a well-formed place may name any node
        assert all(":" in how for _, how in losses)
        claimed = claim_loss(me, Peer(2, "n2", "10.0.0.3", 29400, 7, None), "silent", "gone")
        assert claimed is not None  # the round is still the job's: no one was replaced
        now = time.time()
        mine = Claim("rank failed", "n0", 0, 0, "signal SIGKILL", now, now, 1)
        verdicts: list = [None] * 3
        threads = [
            threading.Thread(target=lambda i=i: verdicts.__setitem__(
                i, agree(rounds[i], mine if i == 0 else None, 3, 5.0)))
            for i in range(3)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        culprits = {v.culprit for v in verdicts if v is not None}
        # without a secret a well-formed claim is a node's as far as anyone can tell:
        # it may win; one that is not well formed never does
        forged = garbage.get(KEYS.fault_claim)
        claims = {mine} | ({Claim.loads(forged)} if _well_formed(forged) and not signed else set())
        assert len(culprits) <= 1 and culprits <= claims
        said = [json.loads(line) for line in event_log.read_text().splitlines()]
        said = [e for e in said if e["kind"] == "record_refused"]
        causes = {"unsigned", "bad_signature"} if signed else {"malformed"}
        assert {e["cause"] for e in said} <= causes
        keys_said = [e["key"] for e in said]  # once by each node (all 3 in this process)
        assert all(keys_said.count(k) <= 3 for k in keys_said)

    try:
        one_round()
    finally:
        clients.clear()  # their connections close with them, then the server's
        made.clear()
        gc.collect()  # hypothesis's wrapper holds the round's function in a cycle
    assert len(tried) >= ROUNDS  # the examples, and any case hypothesis kept, come on top


def test_a_refused_nodes_record_gives_a_stand_in_that_is_not_watched(event_log: Path) -> None:
    server = _server()
    server.set(KEYS.node(1), json.dumps({**PEER, "port": "29400"}))
    me = _round(_client(server), 0, uuid.uuid4().hex, KEYS)
    peer = me.peers[1]
    assert peer.host == "node rank 1" and not peer.reachable
    (event,) = [json.loads(x) for x in event_log.read_text().splitlines()
                if json.loads(x)["kind"] == "record_refused"]  # fmt: skip
    assert event["key"] == KEYS.node(1) and event["cause"] == "malformed"
    del me, server


def test_a_forged_token_is_read_again_until_node_rank_0s_comes_or_refused() -> None:
    server = _server()
    server.set(KEYS.token, "forged")
    real = uuid.uuid4().hex
    threading.Timer(0.5, lambda: server.set(KEYS.token, real)).start()
    assert round_token(server, KEYS, PeerBook(server, KEYS, {}).refused, 10.0) == real
    server.set(KEYS.token, "forged again")
    with pytest.raises(MalformedRecord, match=r"steadfast/token.*give the job a secret"):
        round_token(server, KEYS, PeerBook(server, KEYS, {}).refused, 0.5)


# ------------------------------------------------------------------ the event log
CORE = {"time": 1.7e9, "kind": "rank_failed", "rank": 1, "step": 10, "cause": "exit 1"}
event_lines = st.one_of(
    st.text(max_size=300),
    json_values.map(json.dumps),
    broken(json.dumps(CORE)).map(lambda b: b.decode("utf-8", "replace")),
    st.sampled_from(
        [
            '{"time": NaN, "kind": "x"}',
            '{"time": 1e999, "kind": "x"}',
            "[" * 100_000,
            '{"time": 1, "kind": ""}',
        ]
    ),
)


@settings(max_examples=1000, deadline=None)
@given(event_lines)
def test_an_event_line_is_an_event_or_refused(line: str) -> None:
    try:
        event = parse_event(line)
    except EventLogError as exc:
        assert str(exc).startswith("<event>")
        return
    assert isinstance(event.time, float) and event.time == event.time  # finite, not NaN
    assert event.kind and (event.rank is None or isinstance(event.rank, int))


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(event_lines, max_size=20))
def test_a_log_with_broken_lines_yields_its_events_and_names_the_rest(lines, tmp_path_factory):
    path = tmp_path_factory.mktemp("log") / "events.jsonl"
    good = json.dumps(CORE)
    path.write_text("\n".join([good, *[x.replace("\n", " ") for x in lines], good]) + "\n")
    problems: list[str] = []
    events = list(read_events(path, problems=problems))
    assert len(events) >= 2 and events[0].kind == events[-1].kind == "rank_failed"
    assert all(str(path) in p for p in problems)
