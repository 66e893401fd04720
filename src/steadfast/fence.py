"""The checkpoint fence, the workers' side: may this rank write to the shared checkpoint
directory now?

Only the group that holds the job's rendezvous may move ``latest`` (no split brain). Under
``steadfast launch`` on more than one node, the launcher exports ``STEADFAST_FENCE``, the
address of a local socket on which it answers, after a live round trip to the
rendezvous store, whether this node is still in the job's current round: a node cut off
by a partition, or one the job went on without, is fenced. The
:class:`~steadfast.CheckpointManager` asks before it writes anything and again before it
moves ``latest``; without the variable (one node, or not under the launcher) every write
is allowed.

This module imports nothing heavy: it is called on the save path of every rank.
"""

from __future__ import annotations

import os
import socket

__all__ = ["FENCE_ENV", "FENCE_TIMEOUT_ENV", "check"]

#: The launcher's fence address (an abstract Unix socket name, ``@``-prefixed).
FENCE_ENV = "STEADFAST_FENCE"
#: How long the launcher may take to answer (its ``node_heartbeat_timeout``, plus 1 s).
FENCE_TIMEOUT_ENV = "STEADFAST_FENCE_TIMEOUT"


def _address(text: str) -> str:
    return "\0" + text[1:] if text.startswith("@") else text


def check(timeout: float | None = None) -> str | None:
    """None when this rank may write; else the reason it may not (the launcher's answer,
    or why there was none: a launcher that cannot answer cannot vouch for the node)."""
    where = os.environ.get(FENCE_ENV)
    if not where:
        return None
    if timeout is None:
        try:
            timeout = float(os.environ.get(FENCE_TIMEOUT_ENV, "6"))
        except ValueError:
            timeout = 6.0
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(_address(where))
            sock.sendall(b"?\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        return f"the launcher's fence did not answer ({type(exc).__name__}: {exc})"
    answer = reply.decode(errors="replace").strip()
    if answer == "ok":
        return None
    return answer.removeprefix("fenced:").strip() or "the launcher gave no answer"
