"""The job's store, bound to the job's secret (:mod:`steadfast.secret`): only the job's
own nodes steer it.

:class:`SignedStore` sits between the rendezvous and the store client (a TCPStore, an
etcd), so every record the rendezvous and the node roster write (tickets, verdicts,
loss claims, fences, culprit claims, the exit barrier's marks: all go through the
rendezvous's store or a ``PrefixStore`` on it) is bound the same way:

- **Keys under a prefix derived from the secret** (and the run's id): a job that uses
  the same ``--rdzv-id`` on the same store with another secret (a reused job name, a
  second job on a reused port) has keys of its own, and forms its own rounds; a peer
  that does not hold the secret cannot name the job's keys. Counters (``add``) carry no
  value to sign: this prefix is what keeps them the job's.
- **Every value sealed**: an HMAC-SHA256 (the standard library's ``hmac``) of the full
  key and the value is appended. The key holds the round (``<r>/verdict``,
  ``<r>/s/...``) and the job, so a record copied from another key, an earlier round or
  another job does not open. A value that does not open is never returned: the call
  raises :class:`RecordRefused` (a ``DistStoreError``: the rendezvous and the roster
  treat it as the store failing that call) and a ``record_refused`` event names the key
  and the writer the record claims, once per key.

What it cannot stop: a peer that reaches the store may still delete keys or fill it
(a TCPStore has no access control; etcd's users and TLS, :mod:`.etcd_access`, close
that), and, having read one, may write an earlier value of a key whose name holds no
round back into it (the round counter, a node's heartbeat): that can stall a round or
leave a node out, as deleting a key can; it cannot make the job act on a record its
nodes did not write.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
from typing import Any

import torch.distributed as dist

from ..records import Refusals

__all__ = ["RecordRefused", "SignedStore", "bind", "bind_roster", "job_prefix", "round_view"]

logger = logging.getLogger(__name__)

#: The seal appended to each value: a separator and the MAC's first 16 bytes, in hex.
_SEP = b"\x1f"
_MAC_BYTES = 16
_SEAL = len(_SEP) + 2 * _MAC_BYTES


class RecordRefused(dist.DistStoreError):
    """A record not bound to the job's secret: never acted on."""


def job_prefix(secret: bytes, scope: str) -> str:
    """The key prefix of the job ``scope`` (its run id) under ``secret``."""
    digest = hmac.new(secret, b"steadfast-prefix\0" + scope.encode(), hashlib.sha256)
    return f"/sf-{digest.hexdigest()[:24]}/"


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(dist.Store):  # type: ignore[misc,name-defined]
    """A c10d ``Store`` in front of ``store`` whose keys live under the job's prefix and
    whose values are sealed with ``secret``."""

    def __init__(
        self,
        store: Any,
        secret: bytes,
        scope: str,
        *,
        job: SignedStore | None = None,
        prefix: str | None = None,
        refused: Refusals | None = None,
    ) -> None:
        """``scope``: the run's id (a round's, for a round's store); ``job``: the job's
        store, where this is one round's (its ``underlying_store``, as a ``PrefixStore``
        has one: the node roster keeps its job-wide records there)."""
        super().__init__()
        self.store = store
        self._secret = secret
        self.prefix = job_prefix(secret, scope) if prefix is None else prefix
        self._refused = Refusals() if refused is None else refused
        self._job = job
        if job is not None:
            self.underlying_store = job

    def child(self, sub: str) -> SignedStore:
        """The records under ``sub`` (a round's store) at the keys ``PrefixStore(sub,
        self)`` gives them (torch joins with ``/``), in a store that can :meth:`clone`: a
        Python store under torch's C++ ``PrefixStore`` cannot (the clone dies with the
        wrapper)."""
        prefix = f"{self.prefix}{sub}/"
        return SignedStore(
            self.store, self._secret, "", job=self, prefix=prefix, refused=self._refused
        )

    def clone(self) -> SignedStore:
        """The same records over a connection of their own (the client's ``clone``: a
        TCPStore's; ``AttributeError`` for a client that has none, as etcd's)."""
        return SignedStore(
            self.store.clone(),
            self._secret,
            "",
            job=self._job,
            prefix=self.prefix,
            refused=self._refused,
        )

    # ------------------------------------------------------------------ the seal
    def _key(self, key: str) -> str:
        return self.prefix + key

    def _mac(self, full_key: str, value: bytes) -> bytes:
        mac = hmac.new(self._secret, full_key.encode() + b"\0" + value, hashlib.sha256)
        return mac.hexdigest()[: 2 * _MAC_BYTES].encode()

    def seal(self, key: str, value: bytes | str) -> bytes:
        """``value`` as the store holds it at ``key`` (this store's key, unprefixed)."""
        data = _bytes(value)
        return data + _SEP + self._mac(self._key(key), data)

    def open(self, key: str, raw: bytes | str) -> bytes:
        """The value of a record read at ``key``; raises :class:`RecordRefused`."""
        data = _bytes(raw)
        if len(data) < _SEAL or data[-_SEAL : -_SEAL + len(_SEP)] != _SEP:
            self._refuse(key, data, "unsigned")
        value, mac = data[:-_SEAL], data[-2 * _MAC_BYTES :]
        if not hmac.compare_digest(mac, self._mac(self._key(key), value)):
            self._refuse(key, value, "bad_signature")
        return value

    def _refuse(self, key: str, data: bytes, cause: str) -> None:
        self._refused.say(key, data, cause)
        raise RecordRefused(f"store record {key!r} is not bound to this job's secret ({cause})")

    # ------------------------------------------------------------------ the store API
    def set(self, key: str, value: bytes | str) -> None:
        self.store.set(self._key(key), self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self.store.get(self._key(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(self._key(key), amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """c10d's compare-and-set on sealed values (the seal of a value is the same every
        time: a node's ``expected`` matches what another node wrote)."""
        want = self.seal(key, expected) if _bytes(expected) else b""
        answer = _bytes(self.store.compare_set(self._key(key), want, self.seal(key, desired)))
        return self.open(key, answer)

    def check(self, keys: list[str]) -> bool:
        return bool(self.store.check([self._key(k) for k in keys]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        full = [self._key(k) for k in keys]
        if timeout is None:
            self.store.wait(full)
        else:
            self.store.wait(full, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raw = self.store.multi_get([self._key(k) for k in keys])
        return [self.open(k, v) for k, v in zip(keys, raw, strict=True)]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        sealed = [self.seal(k, v) for k, v in zip(keys, values, strict=True)]
        self.store.multi_set([self._key(k) for k in keys], sealed)

    def num_keys(self) -> int:
        return int(self.store.num_keys())

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(self._key(key)))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.store.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self.store.timeout  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the store client under it, where it has a ``close`` (the etcd store)."""
        close = getattr(self.store, "close", None)
        if callable(close):
            close()


def round_view(store: Any, sub: str) -> Any:
    """The round's store under ``sub``: a :class:`SignedStore`'s :meth:`~SignedStore.child`,
    else torch's ``PrefixStore``."""
    if isinstance(store, SignedStore):
        return store.child(sub)
    return dist.PrefixStore(sub, store)  # type: ignore[attr-defined]


def bind_roster(store: Any, run_id: str, round_number: int | None) -> Any:
    """The node roster's view of a round's ``store`` bound to the job's secret, where
    the rendezvous that handed it out binds nothing (torch's c10d and static, etcd-v2):
    the job's records under the run's prefix, the round's under the round's
    (``round_number``: the rendezvous's, where it has one; under static the roster's
    keys hold the round already). Unchanged without a secret, or already bound
    (steadfast's rendezvous)."""
    from ..secret import load_secret

    if isinstance(store, SignedStore):
        return store
    secret = load_secret()
    if secret is None:
        return store
    base = getattr(store, "underlying_store", None)
    job = SignedStore(store if base is None else base, secret, run_id)
    if base is None:  # one store for the job and its rounds (etcd-v2)
        return job
    scope = run_id if round_number is None else f"{run_id}\0round{round_number}"
    return SignedStore(store, secret, scope, job=job, refused=job._refused)


_warned_open = False


def bind(store: Any, run_id: str, max_nodes: int) -> Any:
    """``store`` bound to the job's secret (:mod:`steadfast.secret`), where the job has
    one; a job of several nodes without one is told once that anyone who reaches its
    store can steer it."""
    global _warned_open
    from ..secret import SECRET_FILE_ENV, load_secret

    secret = load_secret()
    if secret is not None:
        return SignedStore(store, secret, run_id)
    if max_nodes > 1 and not _warned_open:
        _warned_open = True
        logger.warning(
            "this job has no secret: its control plane is open, and anyone who reaches its "
            "rendezvous store can join its rounds, write its verdicts or fence its nodes "
            "(steadfast slurm makes one per job; elsewhere set $%s to a 0600 file)",
            SECRET_FILE_ENV,
        )
    return store
