"""Silent data corruption found in minutes: replicas that must agree are checked.

- :mod:`.fingerprint`: what is hashed and how (order-sensitive, in chunks);
- :mod:`.layout`: where a worker publishes its checks (its heartbeat-table row);
- :mod:`.probe`: the worker's side, started by the progress hooks on a DDP model;
- :mod:`.compare`: one check judged, the odd one out named;
- :mod:`.board`: the launcher's side, on the node and along the ring of nodes;
- :mod:`.verdict`: the verdict a user acts on;
- :mod:`.audit`: the library's compute audits, a step's gradients recomputed elsewhere.

See docs/silent-corruption.md.
"""

from .audit import ComputeAudit
from .compare import Judgment, judge
from .fingerprint import flip_bit
from .verdict import Verdict

__all__ = ["ComputeAudit", "Judgment", "Verdict", "flip_bit", "judge"]
