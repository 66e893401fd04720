"""The node roster of one launcher: which nodes are in the running round, which of them
are lost, and whether this node still holds the job's rendezvous.

Each launcher of a job of more than one node runs a :class:`NodeRoster`:

- a **beacon**: a TCP socket that the launchers watching this node connect to; it sends
  them one byte every ``node_heartbeat_interval``;
- a **ring watch**: after each rendezvous every launcher publishes its beacon in the
  round's store and connects to the beacons of the next two nodes of the round (by node
  rank, wrapping), so each node is watched by two others and each launcher holds two
  connections whatever the job's size. A node killed outright (power loss, kernel panic,
  OOM killer taking the launcher) resets those connections at once; one that goes silent
  (a NIC, a partition) is lost after ``node_heartbeat_timeout`` without a beat. A
  launcher whose workers finished says goodbye (one byte) before it closes, so that its
  leaving at the end of the job is not taken for a loss;
- **confirmation**: a watcher that sees a loss records it in the round's store (the
  first to do so emits ``node_lost``), where the other launchers find it when their own
  workers fail. A watcher that cannot reach the store either is the one cut off: it
  emits ``node_isolated`` and stops its workers instead;
- the **fence**: a local socket on which the launcher answers its ranks whether the node
  is still in the job's current round (a live round trip to the rendezvous store: the
  round's token must still be the job's). :mod:`steadfast.fence` is the ranks' side.

Everything runs in one thread (a selector over the beacon, the watched and the
watching connections and the fence socket) plus two threads for store calls (the
fence's probes, the confirmations), which can block for as long as the store's own
timeout: a call that overruns its deadline is answered as failed and the thread goes on
with it in the background.

The modules:

- :mod:`.roster`: :class:`NodeRoster`, the front the agent uses; it owns a round's
  lifetime (its states and their transitions: :class:`~.roster.RosterState`) and what
  this node knows of the round's losses;
- :mod:`.round`: :class:`Peer`, :class:`Loss`, the round as the roster holds it, and
  every key the roster keeps in the stores (:class:`~.round.RoundKeys`);
- :mod:`.ring`: the beacon and the ring watch over sockets, and the loop's thread;
- :mod:`.confirm`: losses in the round's store (recording, reading back, the exit
  barrier's) and the ``node_lost``, ``node_isolated`` and ``node_joined`` events;
- :mod:`.exit_barrier`: the job's end across nodes (every node finished or lost, up to
  a bound);
- :mod:`.culprit`: the one culprit of a round's fault, agreed through the round's store
  (every node's log names the same one);
- :mod:`.fence`: the fence's socket and its answers to the ranks;
- :mod:`.store_calls`: the store threads and the deadlines of their calls;
- :mod:`.health`: the node health check run before each rendezvous.
"""

from __future__ import annotations

from .health import GpuCheck, health_check
from .ring import WATCHERS
from .roster import CONFIRM_MIN, NodeRoster
from .round import Loss, Peer

__all__ = [
    "CONFIRM_MIN",
    "WATCHERS",
    "Loss",
    "NodeRoster",
    "Peer",
    "GpuCheck",
    "health_check",
]
