"""A simulator worker process: ``python -m sfsim.worker IN_FD OUT_FD`` holds some
of the simulated nodes (``cluster.serve``), driven over the two pipes its parent opened."""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from .nodes import serve

if __name__ == "__main__":
    serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
