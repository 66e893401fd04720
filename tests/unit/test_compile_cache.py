"""The job's compile cache (steadfast.launcher.compile_cache): what is copied between a
node and the run directory, and never copied (torch's files in the making, its locks);
and, with real Inductor compilations, that a cache written by another torch or for
another model is never used (its keys differ), while the same model's is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from steadfast.launcher.compile_cache import CACHE_ENV, CompileCache, sync


def node_tmp(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """This process's temporary folder, as a node's own (tempfile reads it once)."""
    monkeypatch.setenv("TMPDIR", str(path))
    path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", None)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_sync_copies_finished_entries_it_lacks_and_never_rewrites_one(tmp_path: Path):
    src, dst = tmp_path / "node", tmp_path / "shared"
    (src / "fxgraph" / "ab").mkdir(parents=True)
    (src / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    (src / "c2").mkdir()
    (src / "c2" / "kernel.so").write_bytes(b"so")
    (src / "c2" / ".kernel.so.1234.tmp").write_bytes(b"half")  # torch still writing it
    (src / "locks").mkdir()
    (src / "locks" / "k.lock").write_bytes(b"")
    (dst / "c2").mkdir(parents=True)
    (dst / "c2" / "kernel.so").write_bytes(b"another node's, the same key")
    assert sync(src, dst) == 1
    assert files(dst) == {
        "fxgraph/ab/entry": b"graph",
        "c2/kernel.so": b"another node's, the same key",
    }
    assert sync(src, dst) == 0  # nothing left to copy, and no temporary file left behind


def test_a_users_cache_directory_is_kept_and_a_job_gets_one_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    node_tmp(monkeypatch, tmp_path)
    ours = CompileCache("job/1", tmp_path / "run" / "compile-cache")
    assert not ours.users and ours.local.parent == tmp_path and "job_1" in ours.local.name
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    users = CompileCache("job/1", None)
    assert users.users and users.env() == {CACHE_ENV: str(tmp_path / "mine")}
    assert users.seed() == users.publish() == 0  # no run directory: nothing shared


def test_a_spare_is_seeded_with_what_a_node_published(tmp_path: Path, monkeypatch):
    shared = tmp_path / "run" / "compile-cache"
    monkeypatch.delenv(CACHE_ENV, raising=False)
    node_tmp(monkeypatch, tmp_path / "node1")
    node1 = CompileCache("job", shared)
    (node1.local / "fxgraph").mkdir(parents=True)
    (node1.local / "fxgraph" / "entry").write_bytes(b"graph")
    node1.publish_soon()
    node1.close()
    node_tmp(monkeypatch, tmp_path / "spare")
    spare = CompileCache("job", shared)
    assert spare.local != node1.local
    assert spare.seed() == 1 and files(spare.local) == {"fxgraph/entry": b"graph"}
    assert not node1.local.exists()  # its launcher ended: the run directory has the copy
    spare.close()
    assert not spare.local.exists() and files(shared / "inductor") == {"fxgraph/entry": b"graph"}


COMPILE = textwrap.dedent(
    """
    import json, sys, torch
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    kind, torch_id = sys.argv[1], sys.argv[2]
    if torch_id != "this":  # another torch: what its cache keys hold of torch differs
        import torch._inductor.codecache as codecache
        codecache.torch_key = lambda: torch_id.encode()
    layers = [torch.nn.Linear(8, 8)] + ([torch.nn.ReLU()] if kind == "relu" else [])
    model = torch.nn.Sequential(*layers)
    x = torch.randn(4, 8)
    assert torch.allclose(torch.compile(model)(x), model(x))  # right, whatever the cache
    print(json.dumps(dict(counters["inductor"])))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)  # four interpreters, three C++ builds: 37 s idle, 105 s in a soak
def test_a_cache_of_another_torch_or_another_model_is_not_used(tmp_path: Path):
    """Real Inductor compilations into one cache directory: the same model and torch hit
    it; another model, or another torch (its ``torch_key``, which Inductor's keys hold),
    miss it and compile their own."""
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}

    def compile_(kind: str, torch_id: str) -> dict[str, int]:
        done = subprocess.run(
            [sys.executable, "-c", COMPILE, kind, torch_id],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    assert compile_("linear", "this").get("fxgraph_cache_miss") == 1
    assert compile_("linear", "this").get("fxgraph_cache_hit") == 1
    assert compile_("relu", "this").get("fxgraph_cache_miss") == 1  # another model
    other = compile_("linear", "another torch")
    assert other.get("fxgraph_cache_miss") == 1 and not other.get("fxgraph_cache_hit"), other


def test_the_precompiled_header_goes_along_only_with_cpu_kernels(tmp_path: Path, monkeypatch):
    """Inductor's CPU header (150 MB) is shared only by a job that built CPU kernels."""
    shared = tmp_path / "run" / "compile-cache"
    monkeypatch.delenv(CACHE_ENV, raising=False)
    node_tmp(monkeypatch, tmp_path / "node1")
    node1 = CompileCache("job", shared)
    headers = tmp_path / "node1" / "torchinductor_root" / "precompiled_headers"
    headers.mkdir(parents=True)
    (headers / "h.h.gch").write_bytes(b"pch")
    (node1.local / "fxgraph").mkdir(parents=True)
    (node1.local / "fxgraph" / "entry").write_bytes(b"graph")
    assert node1.publish() == 1  # the graph alone: no CPU kernel, no header
    (node1.local / "c2").mkdir()
    (node1.local / "c2" / "k.so").write_bytes(b"kernel")
    assert node1.publish() == 2 and files(shared / "precompiled_headers") == {"h.h.gch": b"pch"}
    node_tmp(monkeypatch, tmp_path / "spare")
    spare = CompileCache("job", shared)
    assert spare.seed() == 3
    assert files(tmp_path / "spare" / "torchinductor_root" / "precompiled_headers") == {
        "h.h.gch": b"pch"
    }


def test_a_users_folder_that_is_torchs_default_shares_no_headers_with_its_entries(
    tmp_path: Path, monkeypatch
):
    """Inductor sets TORCHINDUCTOR_CACHE_DIR to its default folder in any process that
    compiled, and its children inherit it: a launcher started from such a process takes
    that folder for the user's own. Its precompiled headers (150 MB each) are not
    entries of the job's: they are not copied with them (seen: 300 MB in the run
    directory of every e2e test, for jobs that compiled nothing)."""
    default = tmp_path / "torchinductor_root"
    (default / "precompiled_headers").mkdir(parents=True)
    (default / "precompiled_headers" / "h.h.gch").write_bytes(b"pch")
    (default / "fxgraph").mkdir()
    (default / "fxgraph" / "entry").write_bytes(b"graph")
    monkeypatch.setenv(CACHE_ENV, str(default))
    node_tmp(monkeypatch, tmp_path / "node1")
    shared = tmp_path / "run" / "compile-cache"
    cache = CompileCache("job", shared)
    assert cache.publish() == 1  # the graph alone
    assert not (shared / "inductor" / "precompiled_headers").exists()
