"""The names steadfast gives what it makes in ``/dev/shm``: a heartbeat table and its
channels (``steadfast-hb-*``, ``-hbwake-*``, ``-hbask-*``), a job's memory tier
(``steadfast-mem-*``).

Each name carries its maker's pid first (orphan sweeps read it), then the job's *tag*
where there is one: ``$STEADFAST_SHM_TAG``, else ``job<SLURM_JOB_ID>`` under Slurm. On a
node shared by several jobs, ``ls /dev/shm`` then says whose each entry is, and a job's
leftovers can be found by its tag (a test suite gives its own launches a tag of its own,
so that its leak check counts only what it made, not a neighbour job's live segments).
A tag keeps letters, digits, ``_`` and ``.`` (anything else is dropped) and at most 32
characters: it must not change where a name ends.
"""

from __future__ import annotations

import os
import re

__all__ = ["TAG_ENV", "shm_name", "shm_tag"]

#: the environment variable that names a job's tag
TAG_ENV = "STEADFAST_SHM_TAG"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")


def shm_tag() -> str:
    """This job's tag ("" where none is set)."""
    tag = os.environ.get(TAG_ENV)
    if tag is None:
        job = os.environ.get("SLURM_JOB_ID")
        tag = f"job{job}" if job else ""
    return _UNSAFE.sub("", tag)[:32]


def shm_name(prefix: str) -> str:
    """The start of a new name under ``prefix``: ``PREFIX<pid>-`` and, with a tag,
    ``PREFIX<pid>-<tag>-``; the maker adds what makes it unique."""
    tag = shm_tag()
    return f"{prefix}{os.getpid()}-{tag + '-' if tag else ''}"
