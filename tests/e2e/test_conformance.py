"""A worker of ``steadfast launch`` is the process torchrun would have started (issue
50): one probe (``conformance_probe.py``) under torchrun and under ``steadfast launch``
with the same flags, with the worker template and without it, compared field by field
(``STEADFAST_PROBE_CUDA=1``, as ``make gpu-check`` runs it: each rank on the GPU too,
CUDA not yet initialised in a worker the template forked).
A field may differ only where docs/guides/unchanged-scripts.md ("What differs from
torchrun") lists it, with its reason: a new difference fails here and names itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
PROBE = HERE / "conformance_probe.py"
PAGE = HERE.parent.parent / "docs" / "guides" / "unchanged-scripts.md"
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_worker_outlives_its_launcher")]


def listed() -> dict[str, str]:
    """The page's table: field -> when it may differ (``always`` or ``template``)."""
    text = PAGE.read_text().split("## What differs from torchrun", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([\w.]+)` \| (always|template) \|", text, re.M))


def probe(tmp_path: Path, name: str, launcher: list[str]) -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    env = dict(os.environ, PROBE_OUT=str(out))
    done = subprocess.run(
        [*launcher, "--standalone", "--nproc-per-node=2", str(PROBE), "same-args"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]


def differences(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> set[str]:
    """The fields whose value (the random draws: whether they differ across ranks) is not
    torchrun's."""
    found = set()
    for field, value in theirs[0].items():
        if field == "draws":
            for kind in value:
                distinct = theirs[0]["draws"][kind] != theirs[1]["draws"][kind]
                if (ours[0]["draws"][kind] != ours[1]["draws"][kind]) != distinct:
                    found.add(f"draws.{kind}")
        elif any(o[field] != t[field] for o, t in zip(ours, theirs, strict=True)):
            found.add(field)
    return found


def test_a_worker_is_the_process_torchrun_starts_but_for_what_the_docs_list(tmp_path: Path):
    allowed = listed()
    assert allowed, "the page lists no difference: the table moved?"
    torchrun = probe(tmp_path, "torchrun", [str(BIN / "torchrun")])
    assert all(torchrun[0]["draws"][k] != torchrun[1]["draws"][k] for k in torchrun[0]["draws"])
    launch = [str(BIN / "steadfast"), "launch"]
    for mode, flags in (("template", []), ("plain", ["--ft-worker-template=false"])):
        ours = probe(tmp_path, mode, [*launch, *flags])
        unlisted = {
            field
            for field in differences(ours, torchrun)
            if allowed.get(field) not in ("always", mode)
        }
        assert not unlisted, f"{mode}: not torchrun's, and not in {PAGE.name}: {sorted(unlisted)}"
        for field in ("torch", "numpy", "random", "authkey"):  # fresh in every worker
            assert ours[0]["draws"][field] != ours[1]["draws"][field], (mode, field)
        if os.environ.get("STEADFAST_PROBE_CUDA") == "1":  # make gpu-check: on CUDA
            for got in ours:
                assert got["cuda"]["works"] and not got["cuda"]["initialized_before"], got["cuda"]
