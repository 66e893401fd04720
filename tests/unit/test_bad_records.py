"""Bad input never steers the job (issue 39, part 3): hypothesis throws at the
rendezvous's readers everything a broken or hostile peer could write (truncated
records, wrong types, oversized values, stale rounds, records replayed from another
round or sealed for another key) and checks that each is refused with a clear error or
ignored: nothing crashes, and no round takes in a node that did not join it.

The number of cases tried is each test's ``max_examples`` (hypothesis runs them all on
a passing test): 1,000 records for each reader, 25 rounds on a real store."""

from __future__ import annotations

import datetime
import gc
import json
import math

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sfharness import join_rendezvous
from steadfast.rendezvous.handler import Settings, SteadfastRendezvousHandler
from steadfast.rendezvous.keys import Keys, MalformedRecord, Verdict, parse_holder
from steadfast.rendezvous.signed import RecordRefused, SignedStore

pytestmark = pytest.mark.timeout(600)

SECRET = b"k" * 32

#: any JSON value, nested a little; floats include the non-finite ones
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=20,
)
#: a real holder record, then broken: cut short, a field of the wrong type, too long
good_holder = st.tuples(
    st.text(min_size=1, max_size=20), st.integers(-1, 64), st.floats(0, 2e9),
    st.text(max_size=20), st.integers(1, 65535), st.sampled_from([0, 1]),
).map(list)  # fmt: skip


@st.composite
def broken_holders(draw: st.DrawFn) -> bytes:
    record = draw(good_holder)
    how = draw(st.sampled_from(["truncate", "retype", "oversize", "any", "bytes"]))
    if how == "truncate":
        text = json.dumps(record)
        return text[: draw(st.integers(0, len(text) - 1))].encode()
    if how == "retype":
        record[draw(st.integers(0, 5))] = draw(json_values)
    elif how == "oversize":
        record[draw(st.sampled_from([0, 3]))] = "x" * draw(st.integers(4097, 100_000))
    elif how == "any":
        return json.dumps(draw(json_values)).encode()
    else:
        return draw(st.binary(max_size=200))
    return json.dumps(record).encode()


READ = {"holders": 0, "verdicts": 0}


@settings(max_examples=1000, deadline=None)
@given(broken_holders())
def test_a_holder_record_is_a_nodes_or_refused(raw: bytes) -> None:
    READ["holders"] += 1
    try:
        info = parse_holder(raw)
    except MalformedRecord:
        return
    assert isinstance(info[0], str) and info[0] and len(info[0]) <= 4096
    assert isinstance(info[1], int) and info[1] >= -1 and math.isfinite(info[2])
    assert 0 <= info[4] <= 65535


@settings(max_examples=1000, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200).map(bytes),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries({
            "w": json_values | st.integers(), "p": json_values | st.integers(),
            "v": st.text(alphabet="0123456789-,", max_size=30),
            "n": st.text(alphabet="0123456789-,", max_size=30) | json_values,
        }).map(lambda v: json.dumps(v).encode()),
    )
)  # fmt: skip
def test_a_verdict_is_a_nodes_or_refused(raw: bytes) -> None:
    READ["verdicts"] += 1
    try:
        verdict = Verdict.from_json(raw)
    except MalformedRecord:
        return
    assert verdict.world >= 1
    for ticket, seat in ((1, 0), (2, -1), (3, 5)):
        rank = verdict.rank(ticket, seat)  # never raises, never loops long
        assert rank is None or isinstance(rank, int)


def _parses(raw: bytes) -> bool:
    try:
        parse_holder(raw)
    except MalformedRecord:
        return False
    return True


def _server() -> dist.TCPStore:  # type: ignore[name-defined]
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True
    )


def _client(server: dist.TCPStore) -> dist.TCPStore:  # type: ignore[name-defined]
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=20)
    )


def _nodes(server: dist.TCPStore, sealed: bool) -> list[SteadfastRendezvousHandler]:  # type: ignore[name-defined]
    settings_ = Settings("job", 2, 2, join_timeout=10, last_call_timeout=0.5,
                         local_addr="127.0.0.1")  # fmt: skip
    stores = [SignedStore(_client(server), SECRET, "job") if sealed else _client(server)
              for _ in range(2)]  # fmt: skip
    return [SteadfastRendezvousHandler(s, settings_, node=f"real{i}") for i, s in enumerate(stores)]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(broken_holders(), min_size=1, max_size=4), st.booleans())
def test_a_round_is_formed_by_its_real_nodes_whatever_else_holds_a_ticket(
    garbage: list[bytes], sealed: bool
) -> None:
    """A peer takes tickets of round 0 and writes broken records at them (or, with a
    secret, records that do not open, among them a real holder's sealed for another
    round): the two real nodes form the round of two, and nothing else is in it.
    Without a secret a well-formed record is a node's as far as anyone can tell: only
    the broken ones are thrown there."""
    if not sealed:
        assume(not any(_parses(raw) for raw in garbage))
    server = _server()
    keys = Keys("job")
    prefix = SignedStore(server, SECRET, "job").prefix if sealed else ""
    for raw in garbage:
        ticket = int(server.add(prefix + keys.ticket(0), 1))
        server.set(prefix + keys.holder(0, ticket), raw)
    if sealed:  # a real record of round 1, replayed into round 0
        other = SignedStore(server, SECRET, "job")
        ticket = int(server.add(prefix + keys.ticket(0), 1))
        forged = json.dumps(["ghost", -1, 1e9, "127.0.0.1", 1, 1])
        server.set(prefix + keys.holder(0, ticket), other.seal(keys.holder(1, ticket), forged))
    nodes = _nodes(server, sealed)
    formed = join_rendezvous(*nodes)
    assert sorted(formed.values()) == [(0, 2), (1, 2)], formed
    del formed, nodes, server
    if sealed:
        del other
    gc.collect()  # each example's store server and clients, closed now


def test_the_readers_saw_every_case() -> None:
    """Run after the two property tests in this file (pytest keeps the file's order)."""
    if 0 < READ["holders"] < 1000 or 0 < READ["verdicts"] < 1000:
        pytest.fail(f"fewer cases than asked: {READ}")


def test_a_record_sealed_for_another_key_does_not_open() -> None:
    server = _server()
    store = SignedStore(_client(server), SECRET, "job")
    sealed = store.seal("1/t/1", "x")
    with pytest.raises(RecordRefused):
        store.open("2/t/1", sealed)
