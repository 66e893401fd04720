"""``--rdzv-backend steadfast`` from torch's ``RendezvousParameters``: the store (c10d's
TCP store, or an etcd cluster's v3 API) and the settings (``--nnodes``, ``--rdzv-conf``),
bound to the job's secret, into a :class:`.handler.SteadfastRendezvousHandler`."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from .handler import Settings, SteadfastRendezvousHandler

__all__ = ["create_handler"]


def _hosts_store(endpoint: str, local_addr: str | None) -> bool:
    """Whether the rendezvous endpoint's host is this machine (it hosts the store), by
    name or by address."""
    host = endpoint.strip().rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    if local_addr and host == local_addr:
        return True
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(mine & theirs)


def _seconds(params: RendezvousParameters, name: str, default: float) -> float:
    raw = params.get(name, None)
    if raw is None:
        return default
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf {name}: {raw!r} is not a number of seconds") from None


def create_handler(params: RendezvousParameters) -> SteadfastRendezvousHandler:
    """torch's rendezvous registry's creator for ``--rdzv-backend steadfast``: the store
    as torch's c10d backend makes it (``--rdzv-endpoint``; ``is_host``, ``read_timeout``
    and ``store_type`` in ``--rdzv-conf``), or, with ``store_type=etcd``, an etcd
    cluster's v3 API at the comma-separated ``--rdzv-endpoint`` (:mod:`.etcd`; TLS and a
    user: ``cacert``, ``cert``, ``key``, ``user``, ``password_file``, :mod:`.etcd_access`); the
    settings from ``--nnodes`` and ``--rdzv-conf`` (``join_timeout``,
    ``last_call_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``). A
    requeued Slurm job (``SLURM_RESTART_COUNT``) uses keys of its own, so that a store
    that outlived the job's first run (etcd) does not hand it the closed rendezvous of
    the run before. The store is bound to the job's secret, where it has one
    (:mod:`.signed`)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    from .signed import bind

    run_id = params.run_id
    restart = os.environ.get("SLURM_RESTART_COUNT", "").strip()
    if restart and restart != "0":
        run_id = f"{run_id}.requeue{restart}"
    is_host = params.get_as_bool("is_host")
    settings = Settings(
        first=_hosts_store(params.endpoint, params.local_addr) if is_host is None else is_host,
        run_id=run_id,
        min_nodes=int(params.min_nodes),
        max_nodes=int(params.max_nodes),
        join_timeout=_seconds(params, "join_timeout", 600.0),
        last_call_timeout=_seconds(params, "last_call_timeout", 30.0),
        keep_alive_interval=_seconds(params, "keep_alive_interval", 5.0),
        keep_alive_max_attempt=int(_seconds(params, "keep_alive_max_attempt", 3)),
        local_addr=params.local_addr,
    )
    store_type = str(params.get("store_type", "tcp") or "tcp").strip().lower()
    if store_type == "etcd":  # no single point of failure: an etcd cluster's v3 API
        from .etcd import EtcdV3Store
        from .etcd_access import EtcdAccess

        read_timeout = _seconds(params, "read_timeout", 300.0)
        store: Any = EtcdV3Store(
            [e for e in params.endpoint.split(",") if e.strip()],
            prefix="",
            timeout=timedelta(seconds=read_timeout),
            access=EtcdAccess.from_conf(lambda name: params.get(name, None)),
        )
    else:
        _, store = create_backend(params)
    return SteadfastRendezvousHandler(bind(store, run_id, settings.max_nodes), settings)
