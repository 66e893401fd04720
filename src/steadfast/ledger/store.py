"""Where the node ledger lives: a folder on the cluster's shared file system, or an etcd
cluster. Either way each writer (a launcher) owns one entry, named after its host, job
and process, which it replaces whole; no writer ever touches another's entry, and a
reader reads them all.

**Why a folder is safe with many writers, on NFS and Lustre too.** Appending from
several machines to one file is not atomic on NFS (each client computes the end of the
file from its own cached size, so two appends can land on the same bytes), and NFS's
locks are advisory and often off. So no two writers share a file: a writer writes its
entry to a temporary file of its own in the folder, ``fsync``\\ s it, and renames it
over its entry's name (``os.replace``, rename(2)). A rename within one folder is atomic
on a local file system, on NFS (the server performs it as one operation) and on Lustre
(one metadata server operation): a reader that opens the name gets the old entry or the
new one, whole (NFS's close-to-open consistency: the writer closed it before the
rename), never a mix. Readers skip the temporary files (a writer that died between
write and rename leaves one behind: it is never read, and removed once a day old).

**etcd** (``etcd://host:2379,host:2379/prefix``, ``etcds://`` for TLS; etcd options as
``--rdzv-conf`` takes them, as the query: ``?cacert=...&cert=...&key=...&user=...
&password_file=...``): an entry is one key under the prefix, written with one put;
a reader reads the prefix in one range request.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from .records import Entry, LedgerError

__all__ = ["EtcdLedger", "FileLedger", "LedgerStore", "entry_name", "open_ledger"]

logger = logging.getLogger(__name__)

_SUFFIX = ".json"
_TEMP = ".tmp-"
#: a leftover temporary file this old (seconds) is removed by the next writer
_STALE = 86400.0


class LedgerStore(Protocol):
    """A place that holds the ledger's entries."""

    def publish(self, name: str, entry: Entry) -> None: ...

    def entries(self) -> Iterator[Entry]: ...

    def close(self) -> None: ...


def entry_name(host: str, job: str, pid: int, nonce: str) -> str:
    """A writer's entry name: its host, job and process (and a nonce: in a PID
    namespace, process ids repeat), in characters safe in a file or key name."""
    safe = "--".join(re.sub(r"[^A-Za-z0-9_.-]", "_", part)[:80] for part in (host, job))
    return f"{safe}--{pid}-{nonce}"


class FileLedger:
    """The ledger in the folder ``root`` (made when missing)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"FileLedger({str(self.root)!r})"

    def publish(self, name: str, entry: Entry) -> None:
        """Replace entry ``name`` whole (see the module's note on why this is safe)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f"{_TEMP}{name}-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(entry.dumps())
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o644)  # readable by `steadfast nodes` of any user
                os.replace(tmp, self.root / (name + _SUFFIX))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._sync_folder()
        except OSError as exc:
            raise LedgerError(f"node ledger {self.root}: cannot write {name}: {exc}") from None
        self._remove_stale()

    def close(self) -> None:
        """Nothing held open between calls."""

    def _sync_folder(self) -> None:
        """The rename made durable (a crash of this node must not lose it)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _remove_stale(self) -> None:
        now = time.time()
        with contextlib.suppress(OSError):
            for path in self.root.iterdir():
                if path.name.startswith(_TEMP):
                    with contextlib.suppress(OSError):
                        if now - path.stat().st_mtime > _STALE:
                            path.unlink()

    def entries(self) -> Iterator[Entry]:
        """Every writer's entry; :class:`LedgerError` naming the file that is not one."""
        if not self.root.exists():
            return
        try:
            names = sorted(os.listdir(self.root))
        except OSError as exc:
            raise LedgerError(f"node ledger {self.root}: cannot list it: {exc}") from None
        for name in names:
            if name.startswith(_TEMP) or not name.endswith(_SUFFIX):
                continue
            path = self.root / name
            try:
                raw = path.read_bytes()
            except FileNotFoundError:  # removed by an operator meanwhile
                continue
            except OSError as exc:
                raise LedgerError(f"ledger entry {path}: cannot read it: {exc}") from None
            entry = _entry(raw, str(path))
            if entry is not None:
                yield entry


class EtcdLedger:
    """The ledger under ``prefix`` in an etcd cluster (steadfast's v3 client)."""

    def __init__(self, endpoints: list[str], prefix: str, access: Any = None) -> None:
        from ..rendezvous.etcd import EtcdV3Store

        self.where = f"etcd {','.join(endpoints)} {prefix}"
        timeout = datetime.timedelta(seconds=30)
        try:
            self.store = EtcdV3Store(endpoints, prefix=prefix, timeout=timeout, access=access)
        except (ValueError, OSError) as exc:
            raise LedgerError(f"node ledger {self.where}: {exc}") from None

    def __repr__(self) -> str:
        return f"EtcdLedger({self.where!r})"

    def publish(self, name: str, entry: Entry) -> None:
        try:
            self.store.set(name, entry.dumps())
        except RuntimeError as exc:  # DistStoreError, DistNetworkError
            raise LedgerError(f"node ledger {self.where}: cannot write {name}: {exc}") from None

    def entries(self) -> Iterator[Entry]:
        try:
            found = self.store.scan()
        except RuntimeError as exc:
            raise LedgerError(f"node ledger {self.where}: cannot read it: {exc}") from None
        for key, raw in found:
            entry = _entry(raw, f"{self.where} key {key}")
            if entry is not None:
                yield entry

    def close(self) -> None:
        self.store.close()


def _entry(raw: bytes, where: str) -> Entry | None:
    """The entry in ``raw``; one that is not (damaged, another program's file) is said
    once, naming it, and skipped: it must not blind the ledger to the rest."""
    try:
        return Entry.loads(raw, where)
    except LedgerError as exc:
        if where not in _said:
            _said.add(where)
            logger.warning("%s: skipped", exc)
        return None


_said: set[str] = set()


def open_ledger(location: str) -> FileLedger | EtcdLedger:
    """The ledger at ``location``: a folder, or ``etcd[s]://host:port,.../prefix[?...]``.
    :class:`LedgerError` naming what is wrong with it."""
    location = location.strip()
    if not location:
        raise LedgerError("node ledger: the location is empty")
    parsed = urllib.parse.urlsplit(location)
    if parsed.scheme not in ("etcd", "etcds"):
        return FileLedger(location)
    from ..rendezvous.etcd_access import EtcdAccess

    endpoints = [e for e in parsed.netloc.split(",") if e]
    if not endpoints:
        raise LedgerError(f"node ledger {location}: no etcd endpoint (etcd://host:2379/prefix)")
    query = dict(urllib.parse.parse_qsl(parsed.query))
    known = {"cacert", "ca_cert", "cert", "ssl_cert", "key", "ssl_cert_key", "user",
             "password_file"}  # fmt: skip
    unknown = sorted(set(query) - known)
    if unknown:
        raise LedgerError(f"node ledger {location}: unknown option(s) {', '.join(unknown)}")
    try:
        access = EtcdAccess.from_conf(query.get, https=parsed.scheme == "etcds")
    except ValueError as exc:
        raise LedgerError(f"node ledger {location}: {exc}") from None
    prefix = parsed.path.rstrip("/") or "/steadfast-ledger"
    return EtcdLedger(endpoints, prefix, access)
