"""A c10d store on an etcd cluster through etcd's v3 API, spoken as JSON over HTTP (the
gRPC gateway every etcd since 3.4 serves on its client port, ``/v3/...``): steadfast's
rendezvous on a store with no single point of failure (``--rdzv-backend steadfast
--rdzv-endpoint etcd1:2379,etcd2:2379,etcd3:2379 --rdzv-conf store_type=etcd``).

Why this protocol: etcd's v2 API (what torch's ``etcd-v2`` backend and python-etcd
speak) is deprecated upstream and off by default since 3.4; v3's native protocol is gRPC,
whose Python client (``etcd3``) is unmaintained and pins an old protobuf that clashes
with other packages; the JSON gateway needs no client library at all (the standard
library's HTTP client), is served by Debian's etcd 3.4 and every later etcd, and costs a
small JSON envelope per request. Every operation the rendezvous needs is one request:
``add`` and ``compare_set`` are transactions (compare the revision, then put),
``check`` and ``multi_get`` one transaction of many reads, a blocking ``get``/``wait`` a
watch from the revision the key was found missing at. A request that fails on one
member (down, or electing a leader) goes to the next, for up to ``retry_window``
seconds, so the loss of any member (a minority) costs a retry, not the job. A secured
etcd (TLS, client certificates, users) is reached as :mod:`.etcd_access` says.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import http.client
import json
import ssl
import threading
import time
from typing import Any

import torch.distributed as dist

from .etcd_access import EtcdAccess

__all__ = ["EtcdStoreError", "EtcdV3Store"]


class EtcdStoreError(RuntimeError):
    """An etcd request that no member answered within the retry window."""


#: operations per transaction: etcd refuses more than ``--max-txn-ops`` (128 by
#: default) in one, so a read of a round's holders goes in parts of this many
TXN_OPS = 128


def _chunks(items: list[Any]) -> list[list[Any]]:
    return [items[i : i + TXN_OPS] for i in range(0, len(items), TXN_OPS)] or [[]]


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdV3Store(dist.Store):  # type: ignore[misc,name-defined]
    """A c10d ``Store`` whose keys live under ``prefix`` in an etcd cluster reached at
    ``endpoints`` (``host:port`` each); usable through torch's ``PrefixStore``.
    ``timeout``: how long a blocking ``get``/``wait`` waits for a key (the c10d store's
    timeout); ``retry_window``: how long a request keeps trying other members;
    ``access``: TLS and a user (:mod:`.etcd_access`), also implied by ``https://``
    endpoints."""

    def __init__(
        self,
        endpoints: list[str],
        prefix: str = "/steadfast",
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        retry_window: float = 15.0,
        access: EtcdAccess | None = None,
    ) -> None:
        super().__init__()
        if not endpoints:
            raise ValueError("rdzv-endpoint: no etcd endpoint given (host1:2379,host2:2379)")
        https = any(e.strip().startswith("https://") for e in endpoints)
        given = access or EtcdAccess()  # the caller's is left as it is
        self.access = dataclasses.replace(given, https=given.https or https)
        self.access.context()  # a bad certificate file: said now, not at the first request
        self.endpoints = [self._split(e) for e in endpoints]
        self.prefix = prefix.rstrip("/") + "/" if prefix else ""
        self.store_timeout = timeout
        self.retry_window = retry_window
        self._local = threading.local()  # a connection per member per thread
        self._opened: list[http.client.HTTPConnection] = []  # every thread's, for close()
        self._lock = threading.Lock()
        self._preferred = 0
        self._tokens: dict[int, str] = {}  # a user's token per member (etcd_access)

    @staticmethod
    def _split(endpoint: str) -> tuple[str, int]:
        bare = endpoint.strip().removeprefix("http://").removeprefix("https://")
        host, _, port = bare.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rdzv-endpoint: {endpoint!r} is not host:port")
        return host.strip("[]"), int(port)

    # -------------------------------------------------------------------- the transport
    def _post(self, path: str, body: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """One request to a member, trying the next on failure within the window."""
        deadline = time.monotonic() + self.retry_window
        payload = json.dumps(body).encode()
        last: Exception | None = None
        attempt = 0
        renewed = False
        while True:
            index = (self._preferred + attempt) % len(self.endpoints)
            host, port = self.endpoints[index]
            try:
                conn = self._connection(index, timeout)
                status, data = self._request(conn, path, payload, self._headers(index, conn))
                if status == 200:
                    self._preferred = index
                    answer: dict[str, Any] = json.loads(data or b"{}")
                    return answer
                if self.access.user and not renewed and self.access.renews(status, data):
                    renewed = True  # expired, or issued before the auth store changed
                    self._tokens.pop(index, None)
                    continue
                last = EtcdStoreError(self.access.error(f"{host}:{port} {path}", status, data))
                if status < 500:
                    raise last  # a request etcd refuses: another member refuses it too
            except ssl.SSLError as exc:  # certificates: no other member or retry helps
                self._drop(index)
                raise EtcdStoreError(self.access.tls_error(f"{host}:{port}", exc)) from exc
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                self._drop(index)
            attempt += 1
            if time.monotonic() > deadline:
                where = ", ".join(f"{h}:{p}" for h, p in self.endpoints)
                raise EtcdStoreError(f"no etcd member answered {path} ({where}): {last}") from last
            if attempt % len(self.endpoints) == 0:
                time.sleep(0.2)  # every member failed once: an election takes a moment

    @staticmethod
    def _request(
        conn: http.client.HTTPConnection, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        conn.request("POST", path, payload, headers)
        response = conn.getresponse()
        return response.status, response.read()

    def _headers(self, index: int, conn: http.client.HTTPConnection) -> dict[str, str]:
        """The request's headers: with the user's token for this member, which is asked
        for first when there is none (``/v3/auth/authenticate``)."""
        headers = {"Content-Type": "application/json"}
        if not self.access.user:
            return headers
        token = self._tokens.get(index)
        if token is None:
            host, port = self.endpoints[index]
            login = {"name": self.access.user, "password": self.access.password or ""}
            status, data = self._request(
                conn, "/v3/auth/authenticate", json.dumps(login).encode(), dict(headers)
            )
            if status != 200:
                where = f"{host}:{port} /v3/auth/authenticate"
                error = EtcdStoreError(self.access.error(where, status, data))
                if status < 500:
                    raise error
                raise http.client.HTTPException(str(error))  # a member's trouble: the next
            token = self._tokens[index] = str(json.loads(data)["token"])
        headers["Authorization"] = token
        return headers

    def _connection(self, index: int, timeout: float) -> http.client.HTTPConnection:
        conns: dict[int, http.client.HTTPConnection] = getattr(self._local, "conns", {})
        self._local.conns = conns
        conn = conns.get(index)
        if conn is None:
            host, port = self.endpoints[index]
            conn = conns[index] = self.access.connect(host, port, timeout)
            with self._lock:
                self._opened.append(conn)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop(self, index: int) -> None:
        conns: dict[int, http.client.HTTPConnection] = getattr(self._local, "conns", {})
        conn = conns.pop(index, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close every thread's connections (a thread that calls again reconnects)."""
        with self._lock:
            opened, self._opened = self._opened, []
        for conn in opened:
            conn.close()

    # -------------------------------------------------------------------- the store API
    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    def _range(self, key: str) -> tuple[dict[str, Any] | None, int]:
        """The key's record (None when absent) and the store's revision."""
        answer = self._post("/v3/kv/range", {"key": self._key(key)})
        revision = int(answer.get("header", {}).get("revision", 0))
        kvs = answer.get("kvs") or []
        return (kvs[0] if kvs else None), revision

    def set(self, key: str, value: bytes | str) -> None:
        self._post("/v3/kv/put", {"key": self._key(key), "value": _b64(value)})

    def get(self, key: str) -> bytes:
        """The key's value, waiting for it up to the store's timeout (c10d's ``get``)."""
        record, revision = self._range(key)
        if record is None:
            self._watch(key, revision, self.store_timeout.total_seconds())
            record, _ = self._range(key)
            if record is None:
                raise dist.DistStoreError(f"etcd key {key!r} vanished")
        return _unb64(record.get("value", ""))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key`` (0 when absent): a transaction on the
        key's revision, tried again when another writer came between."""
        while True:
            record, _ = self._range(key)
            current = int(_unb64(record.get("value", "")) or b"0") if record else 0
            compare = (
                {"key": self._key(key), "target": "MOD", "result": "EQUAL",
                 "mod_revision": record["mod_revision"]}
                if record else
                {"key": self._key(key), "target": "VERSION", "result": "EQUAL", "version": "0"}
            )  # fmt: skip
            value = current + int(amount)
            put = {"request_put": {"key": self._key(key), "value": _b64(str(value))}}
            answer = self._post("/v3/kv/txn", {"compare": [compare], "success": [put]})
            if answer.get("succeeded"):
                return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """c10d's compare-and-set: ``desired`` is written when the key holds
        ``expected`` (or is absent and ``expected`` is empty); returns the value after."""
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        compare: dict[str, Any] = {"key": self._key(key), "result": "EQUAL"}
        if want:
            compare.update(target="VALUE", value=_b64(want))
        else:
            compare.update(target="VERSION", version="0")
        put = {"request_put": {"key": self._key(key), "value": _b64(new)}}
        read = {"request_range": {"key": self._key(key)}}
        answer = self._post(
            "/v3/kv/txn", {"compare": [compare], "success": [put], "failure": [read]}
        )
        if answer.get("succeeded"):
            return new
        kvs = (answer.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else want

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists: a transaction of compares (per :data:`TXN_OPS`)."""
        for part in _chunks(keys):
            compares = [
                {"key": self._key(k), "target": "VERSION", "result": "GREATER", "version": "0"}
                for k in part
            ]
            if not self._post("/v3/kv/txn", {"compare": compares}).get("succeeded"):
                return False
        return True

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value, a transaction of reads per :data:`TXN_OPS` keys (waiting
        for the absent ones)."""
        while True:
            values: list[bytes | None] = []
            for part in _chunks(keys):
                reads = [{"request_range": {"key": self._key(k)}} for k in part]
                answer = self._post("/v3/kv/txn", {"success": reads})
                for response in answer.get("responses") or []:
                    kvs = response.get("response_range", {}).get("kvs") or []
                    values.append(_unb64(kvs[0].get("value", "")) if kvs else None)
            missing = [k for k, v in zip(keys, values, strict=True) if v is None]
            if not missing:
                return [v for v in values if v is not None]
            self.wait(missing)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        pairs = list(zip(keys, values, strict=True))
        for part in _chunks(pairs):
            puts = [{"request_put": {"key": self._key(k), "value": _b64(v)}} for k, v in part]
            self._post("/v3/kv/txn", {"success": puts})

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists, up to ``timeout`` (the store's by default);
        raises ``DistStoreError`` with "timeout" in its message, as c10d's stores do."""
        if self.check(keys):  # one transaction when every key is there already
            return
        seconds = (timeout or self.store_timeout).total_seconds()
        deadline = time.monotonic() + seconds
        for key in keys:
            record, revision = self._range(key)
            if record is None:
                self._watch(key, revision, max(0.0, deadline - time.monotonic()))

    def _span(self) -> dict[str, str]:
        """Every key under the prefix, as a range request names them (all keys: from
        "\\0" to the end, etcd's "\\0")."""
        if not self.prefix:
            return {"key": _b64("\0"), "range_end": _b64("\0")}
        end = self.prefix[:-1] + chr(ord(self.prefix[-1]) + 1)
        return {"key": _b64(self.prefix), "range_end": _b64(end)}

    def num_keys(self) -> int:
        answer = self._post("/v3/kv/range", {**self._span(), "count_only": True})
        return int(answer.get("count", 0))

    def scan(self) -> list[tuple[str, bytes]]:
        """Every key under the prefix (without it) and its value, in one request."""
        answer = self._post("/v3/kv/range", self._span())
        found = []
        for kv in answer.get("kvs") or []:
            key = _unb64(kv["key"]).decode(errors="replace")
            found.append((key[len(self.prefix) :], _unb64(kv.get("value", ""))))
        return found

    def _watch(self, key: str, revision: int, seconds: float) -> None:
        """Wait for ``key`` to be written after ``revision`` (it was absent then): one
        watch stream, a put event ends it."""
        deadline = time.monotonic() + seconds
        create = {"create_request": {"key": self._key(key), "start_revision": str(revision + 1)}}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {seconds * 1000:.0f}ms, keys: {key}")
            index = self._preferred
            host, port = self.endpoints[index]
            conn = self.access.connect(host, port, min(left, 30.0))
            try:
                conn.request("POST", "/v3/watch", json.dumps(create).encode(),
                             self._headers(index, conn))  # fmt: skip
                response = conn.getresponse()
                if response.status != 200:
                    data = response.read()
                    if not self.access.renews(response.status, data):
                        where = f"{host}:{port} /v3/watch"
                        raise EtcdStoreError(self.access.error(where, response.status, data))
                    self._tokens.pop(index, None)  # expired: the next watch logs in again
                    continue
                while time.monotonic() < deadline:
                    line = response.readline()
                    if not line:
                        break
                    result = json.loads(line).get("result", {})
                    if any(e.get("type", "PUT") == "PUT" for e in result.get("events") or []):
                        return
            except (TimeoutError, OSError, http.client.HTTPException, ValueError):
                # a stream cut (a member down, our own timeout): check, then watch again
                self._preferred = (self._preferred + 1) % len(self.endpoints)
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
            record, revision = self._range(key)
            if record is not None:
                return
            create["create_request"]["start_revision"] = str(revision + 1)
