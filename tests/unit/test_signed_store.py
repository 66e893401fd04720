"""Only the job's own nodes steer it: the job's secret (steadfast.secret) and the store
bound to it (steadfast.rendezvous.signed), on a real TCPStore with real rendezvous
handlers: two jobs with the same --rdzv-id on one store each form their own rounds; a
record not bound to the secret (forged, copied from another key or round, another
job's) is refused, reported once with its key and the writer it names, never acted on."""

from __future__ import annotations

import datetime
import json
import os
import stat
from pathlib import Path

import pytest
import torch.distributed as dist

from sfharness import join_rendezvous
from steadfast import events
from steadfast.rendezvous.handler import Settings, SteadfastRendezvousHandler
from steadfast.rendezvous.keys import Keys
from steadfast.rendezvous.signed import RecordRefused, SignedStore, bind, job_prefix
from steadfast.secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SecretError,
    load_secret,
    make_secret_file,
)

pytestmark = pytest.mark.timeout(120)

SECRET_A = b"a" * 32
SECRET_B = b"b" * 32


def serve() -> dist.TCPStore:  # type: ignore[name-defined]
    """The store's server, a local of the test (a fixture's value would outlive the
    test's leak check)."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True
    )


def client(server: dist.TCPStore) -> dist.TCPStore:  # type: ignore[name-defined]
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


@pytest.fixture
def event_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    return path


def refused(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    found = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in found if e["kind"] == "record_refused"]


def test_it_behaves_as_a_store_and_seals_every_value() -> None:
    server = serve()
    signed = SignedStore(client(server), SECRET_A, "job")
    signed.set("a", b"1")
    assert signed.get("a") == b"1"
    assert signed.add("n", 3) == 3 and signed.add("n", -1) == 2
    assert signed.compare_set("a", "1", "2") == b"2"  # matched: written
    assert signed.compare_set("a", "1", "3") == b"2"  # not: the value now
    assert signed.compare_set("new", "", "x") == b"x"  # absent, expected empty
    assert signed.check(["a", "n"]) and not signed.check(["missing"])
    signed.multi_set(["m1", "m2"], ["x", "y"])
    assert signed.multi_get(["m1", "m2"]) == [b"x", b"y"]
    with pytest.raises(dist.DistStoreError, match=r"(?i)timeout"):  # type: ignore[attr-defined]
        signed.wait(["later"], datetime.timedelta(seconds=0.2))
    prefixed = dist.PrefixStore("3/s/", signed)  # type: ignore[attr-defined]
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v"
    # what the store holds: under the job's prefix, sealed
    raw = server.get(signed.prefix + "a")
    assert raw.startswith(b"2\x1f") and len(raw) == 1 + 33
    assert not server.check(["a"])


def test_the_prefix_is_the_jobs_own() -> None:
    assert job_prefix(SECRET_A, "job") != job_prefix(SECRET_B, "job")
    assert job_prefix(SECRET_A, "job") != job_prefix(SECRET_A, "job.requeue1")
    assert job_prefix(SECRET_A, "job") == job_prefix(SECRET_A, "job")


def test_a_forged_or_moved_record_is_refused_and_reported_once(event_log) -> None:
    server = serve()
    signed = SignedStore(client(server), SECRET_A, "job")
    # unsigned, at the job's own key (a peer that read the prefix off the store)
    server.set(signed.prefix + "1/verdict", json.dumps({"w": 64, "node": "intruder:9"}))
    for _ in range(2):
        with pytest.raises(RecordRefused, match="1/verdict"):
            signed.get("1/verdict")
    # sealed for another key: the verdict of round 1 replayed into round 2
    signed.set("1/t/0", json.dumps({"key": "n0"}))
    server.set(signed.prefix + "2/t/0", server.get(signed.prefix + "1/t/0"))
    with pytest.raises(RecordRefused, match="2/t/0"):
        signed.multi_get(["1/t/0", "2/t/0"])
    # sealed with another secret (another job's, or a guess)
    other = SignedStore(client(server), SECRET_B, "job")
    server.set(signed.prefix + "fence", other.seal("fence", "node2"))
    with pytest.raises(RecordRefused, match="fence"):
        signed.compare_set("fence", "", "node1")
    found = refused(event_log)
    assert [(e["key"], e["cause"], e["peer"]) for e in found] == [
        ("1/verdict", "unsigned", "intruder:9"),
        ("2/t/0", "bad_signature", "n0"),
        ("fence", "bad_signature", None),
    ]


def _handlers(
    store_of, run: str, count: int, join_timeout: float = 30.0
) -> list[SteadfastRendezvousHandler]:
    settings = Settings(
        run, count, count, join_timeout=join_timeout, last_call_timeout=30,
        local_addr="127.0.0.1",
    )  # fmt: skip
    return [SteadfastRendezvousHandler(store_of(), settings, node=f"n{i}") for i in range(count)]


def test_two_jobs_with_the_same_rdzv_id_on_one_store_form_their_own_rounds() -> None:
    """A reused job name on a shared store (or a second job on a reused port): each job
    has its own secret, so its own keys; both form a round of their own nodes."""
    server = serve()
    job_a = _handlers(lambda: SignedStore(client(server), SECRET_A, "train"), "train", 2)
    job_b = _handlers(lambda: SignedStore(client(server), SECRET_B, "train"), "train", 2)
    for h in job_b:
        h.node = "b-" + h.node
    formed = join_rendezvous(*job_a, *job_b)
    assert sorted(formed[h.node] for h in job_a) == [(0, 2), (1, 2)], formed
    assert sorted(formed[h.node] for h in job_b) == [(0, 2), (1, 2)], formed


def test_a_forged_verdict_is_never_acted_on(event_log) -> None:
    """A peer that knows the job's prefix (it could read an etcd) writes round 0's
    verdict without the secret, admitting 64 nodes: no node takes it; each says the
    store failed, and the refusal names the key and the writer the record claims."""
    server = serve()
    handlers = _handlers(lambda: SignedStore(client(server), SECRET_A, "job"), "job", 2, 5.0)
    prefix = job_prefix(SECRET_A, "job")
    server.set(
        prefix + Keys("job").verdict(0),
        json.dumps({"w": 64, "p": 0, "v": "", "n": "0-63", "a": "evil", "o": 1}),
    )
    formed = join_rendezvous(*handlers)
    assert all(isinstance(v, Exception) for v in formed.values()), formed
    formed.clear()  # their causes' frames hold the store clients
    found = refused(event_log)
    assert found and found[0]["key"] == Keys("job").verdict(0) and found[0]["peer"] == "evil"


def test_a_job_without_a_secret_keeps_its_store_as_it_is(monkeypatch) -> None:
    server = serve()
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    store = client(server)
    assert bind(store, "job", 4) is store
    monkeypatch.setenv(SECRET_ENV, "s" * 20)
    assert isinstance(bind(store, "job", 4), SignedStore)


def test_the_secret_comes_from_a_0600_file_or_the_environment(tmp_path: Path) -> None:
    path = make_secret_file(tmp_path / "secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(load_secret({SECRET_FILE_ENV: str(path)}) or b"") == 64
    with pytest.raises(FileExistsError):
        make_secret_file(path)  # never overwritten
    assert load_secret({SECRET_ENV: "x" * 16}) == b"x" * 16
    assert load_secret({}) is None
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="others may read it"):
        load_secret({SECRET_FILE_ENV: str(path)})
    with pytest.raises(SecretError, match="at least 16"):
        load_secret({SECRET_ENV: "short"})
    with pytest.raises(SecretError, match="choose one"):
        load_secret({SECRET_ENV: "x" * 16, SECRET_FILE_ENV: str(path)})
    with pytest.raises(SecretError, match="No such file"):
        load_secret({SECRET_FILE_ENV: str(tmp_path / "absent")})
