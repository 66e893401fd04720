"""Silent data corruption across nodes (issue 69), on the bed: an unchanged DDP script
(``tests/e2e/unchanged_train.py``) on 2 nodes of 2 ranks with torchrun's command line;
after step 25 one bit of rank 3's first weight flips (on node2). The replicas' checks
travel out of band (each node's board compares its ranks, then the next node's through
the round's store): one verdict names rank 3 on node2 the odd one out among four, with
the last step all agreed and the first that disagreed; both launchers stop their
workers and exit 80, none restarts; the node ledger (a shared folder) charges node2,
and ``steadfast nodes`` shows it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "unchanged_train.py"


@pytest.mark.parametrize("backend", ["c10d", "steadfast"])
def test_a_flipped_bit_on_one_node_stops_every_node_with_one_verdict(
    bed_factory: Any, backend: str
):
    bed = bed_factory(2)
    ledger = bed.shared / "ledger"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", backend,
        "--rdzv-endpoint", "node1:29500", "--rdzv-id", "sdc", "--max-restarts", "2",
        "--ft-node-ledger", str(ledger),
    ]  # fmt: skip
    script = [
        "--out", str(bed.shared / "out.pt"), "--snapshot", str(bed.shared / "snap.pt"),
        "--trace", str(bed.shared / "trace"), "--steps", "80", "--pace", "0.05",
        "--corrupt", "exponent:3:25",
    ]  # fmt: skip
    launches = [bed.launch(n, *flags, script=script, program=SCRIPT) for n in ("node1", "node2")]
    end = time.monotonic() + 180
    while any(lc.poll() is None for lc in launches):
        if time.monotonic() > end:
            pytest.fail(f"the launchers did not end:\n{bed.logs()}")
        time.sleep(0.1)
    codes = {lc.node: lc.proc.returncode for lc in launches}
    assert codes == {"node1": 80, "node2": 80}, bed.logs()
    (verdict,) = bed.events("sdc_verdict")
    assert (verdict["culprits"], verdict["cause"]) == ([3], "odd_one_out")
    assert (verdict["hosts"], verdict["local_ranks"], verdict["replicas"]) == (["node2"], [1], 4)
    assert (verdict["last_agreed_step"], verdict["first_bad_step"]) == (19, 29)
    assert bed.events("sdc_detected")  # the mismatch, seen by a board
    assert not bed.events("restart")
    ends = {e["host"]: e["exit_code"] for e in bed.events("launcher_end")}
    assert ends == {"node1": 80, "node2": 80}
    shown = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "nodes", "--ledger", str(ledger), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    nodes = {n["node"]: n for n in json.loads(shown)["nodes"]}
    assert [f["cause"] for f in nodes["node2"]["evidence"]] == ["silent_corruption"], shown
    assert not nodes["node1"]["faults"]
