"""The job's torch.compile cache: a directory of its own on each node, seeded from and
published to the run directory, so that a restart compiles warm on the same node and on
a spare that never ran the job.

torch keeps Inductor's FX graph cache and the AOTAutograd cache on disk by default, in
one directory per user under the system's temporary folder, shared by every job of that
user on the node; a spare has none of it and compiles from cold (a small model's
inductor compile on this machine: 17 s cold, 1.6 s warm). Here:

- **A directory per job and node**: ``TORCHINDUCTOR_CACHE_DIR`` is set for the workers to
  ``<tmp>/steadfast-compile-<uid>-<run id>`` (a user's own ``TORCHINDUCTOR_CACHE_DIR`` is
  kept and used as that directory). It is node-local: compiling writes many small
  files, which a shared file system serves slowly. The launcher removes it when it ends
  once the run directory holds its copy.
- **And Inductor's precompiled C++ header** (CPU kernels: built once per node, 150 MB,
  ~9 s; torch keeps it in its default folder whatever ``TORCHINDUCTOR_CACHE_DIR`` says,
  :func:`steadfast.seam.inductor_header_dir`): a spare with the cached graphs but not the
  header builds it again to load them (11.4 s instead of 2.0 s here).
- **Shared through the run directory** (beside the event log, ``compile-cache/``: under
  ``steadfast slurm`` the job's folder on the shared file system): before each
  generation's workers start, the launcher copies in the entries it lacks (a spare, a
  requeued job on another node); after a generation's first iteration (when its
  compilations are done) and at its end, it copies out the entries the run directory
  lacks.

Why a copy of the directory and not torch's portable artifacts
(``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``): those are called
inside the worker, after and before its compilations; the launcher's copy needs no line
of the script and no hook in it, so an unchanged script is warm too, and it carries what
torch puts in the directory (FX graphs, AOTAutograd entries, built kernels) as torch
wrote it.

Why it is safe with many writers: an entry's path is its cache key (a hash of the graph,
the inputs, torch's own sources and version, the device, the compiler), so two nodes
that publish the same path publish the same entry; each file is written under a
temporary name in its folder and renamed into place (atomic on NFS and Lustre for a
rename within a folder), so a reader never sees half a file, and a name that exists is
never rewritten. Files torch is still writing (its own temporary names, starting with a
dot) and its lock folder are not copied. A cache from another torch or another model is
never used: its keys differ (``tests/unit/test_compile_cache.py`` shows it).

The cache lives on disk, outside the memory tier's budget.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["CACHE_ENV", "SHARED_NAME", "CompileCache", "sync"]

logger = logging.getLogger(__name__)

#: torch's variable for the directory of its compile caches.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: the shared copy's folder in the run directory
SHARED_NAME = "compile-cache"
#: not copied with the cache's entries: torch's locks, and Inductor's precompiled headers
#: (150 MB each), found there when the user's folder is torch's default one (Inductor
#: sets TORCHINDUCTOR_CACHE_DIR to it in any process that compiled, and the processes
#: that process starts inherit it: every e2e test's run directory got 300 MB of them)
#: and shared only by their own path, with CPU kernels of the job's
_SKIP_DIRS = {"locks", "precompiled_headers"}


def sync(source: Path, target: Path) -> int:
    """Copy every finished file of ``source`` that ``target`` lacks (by its path below
    the folder), each through a temporary name and an atomic rename; the files copied.
    Never raises for one file: a cache is an optimization."""
    copied = 0
    if not source.is_dir():
        return 0
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = Path(folder).relative_to(source)
        for name in files:
            if name.startswith(".") or name.endswith(".lock"):
                continue  # torch's own file in the making, or a lock
            dest = target / rel / name
            if dest.exists():
                continue
            tmp = dest.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.part")
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(folder) / name, tmp)
                os.replace(tmp, dest)
                copied += 1
            except OSError as exc:
                logger.debug("compile cache: %s not copied: %s", dest, exc)
                tmp.unlink(missing_ok=True)
    return copied


def _safe(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:80] or "job"


class CompileCache:
    """This node's compile cache for one job (see the module docstring): ``shared``, the
    run directory's copy (None: no run directory, no sharing)."""

    def __init__(self, run_id: str, shared: Path | None) -> None:
        from .. import seam

        own = os.environ.get(CACHE_ENV)
        self.users = bool(own)  # the user's own directory
        default = Path(tempfile.gettempdir()) / f"steadfast-compile-{os.getuid()}-{_safe(run_id)}"
        self.local = Path(own) if own else default
        self.shared = shared
        if shared is not None and shared.resolve() == self.local.resolve():
            self.shared = None  # the user's directory is the shared one: nothing to copy
        self._headers = seam.inductor_header_dir()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        """What the workers' environment gets."""
        return {CACHE_ENV: str(self.local)}

    def seed(self) -> int:
        """Copy in what the run directory has and this node lacks (before workers start)."""
        if self.shared is None:
            return 0
        with self._lock:
            copied = sync(self.shared / "inductor", self.local)
            return copied + sync(self.shared / self._headers.name, self._headers)

    def publish(self) -> int:
        """Copy out what this node compiled and the run directory lacks."""
        if self.shared is None:
            return 0
        with self._lock:
            copied = sync(self.local, self.shared / "inductor")
            # the header only with CPU kernels of this job's (150 MB: not for a job that
            # compiled nothing, or only GPU kernels, however many headers the node has)
            if any(self.local.glob("*/*.so")):
                copied += sync(self._headers, self.shared / self._headers.name)
            return copied

    def publish_soon(self) -> None:
        """:meth:`publish` on a thread of its own (one at a time), so that a slow shared
        file system never holds up the caller."""
        if self.shared is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(
            target=self.publish, name="steadfast-compile-cache", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Publish what is left, wait for it, and remove this node's folder where the run
        directory holds its copy (the next launcher on this node seeds from there; a
        user's own folder is kept)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.publish()
        if self.shared is not None and not self.users:
            shutil.rmtree(self.local, ignore_errors=True)
