"""A simulator of the control plane at scale (issue 28): N simulated nodes' control
planes (no training workers) against a real store, counting what each node asks of the
store. Figures that do not depend on the machine (store operations and bytes per node
per round and per keep-alive interval, messages per loss) come from
:class:`CountingStore`; timings (join, loss -> next round, detection) and memory per
node from the harness. ``cluster.py``: the rendezvous, torch's and steadfast's side by
side; ``roster.py``: the node roster (ring watch, confirmation in the store). See
``bench/bench_control_plane.py`` and docs/control-plane.md. A bench tool, kept out of
the installed package: the benches run with ``bench/`` on the path (their own folder),
the tests through pytest's ``pythonpath``."""

from .cluster import DESIGNS, Loss, Run, simulate_join, simulate_loss
from .store import CountingStore, Tally

__all__ = ["DESIGNS", "CountingStore", "Loss", "Run", "Tally", "simulate_join", "simulate_loss"]
