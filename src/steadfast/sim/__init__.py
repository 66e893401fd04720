"""A simulator of the control plane at scale (issue 28): N simulated nodes' control
planes (no training workers) against a real store, counting what each node asks of the
store. Figures that do not depend on the machine (store operations and bytes per node
per round and per keep-alive interval) come from :class:`CountingStore`; timings (join,
loss -> next round) and memory per node from the harness. See ``bench/bench_control_plane.py``
and docs/control-plane.md."""

from .store import CountingStore, Tally
from .torch_rdzv import Loss, Run, simulate_dynamic, simulate_loss

__all__ = ["CountingStore", "Loss", "Run", "Tally", "simulate_dynamic", "simulate_loss"]
