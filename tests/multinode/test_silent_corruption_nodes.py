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
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

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
    codes = bed.wait_all(launches, 180)
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


LIBRARY = Path(__file__).resolve().parents[1] / "e2e" / "sdc_library.py"
STEPS = "400"  # the bed's nodes find the flip a second or two after it: steps go on


def test_the_library_keeps_the_culprits_node_out_and_a_spare_finishes_bit_exact(
    bed_factory: Any, tmp_path: Path
):
    """The README's second loop on 2 nodes of 2 ranks and a waiting spare: rank 3's
    weight flips after step 25 (node2). The verdict names rank 3 on node2 the odd one
    out; node2 leaves the job (exit 74, its ledger charged), the spare takes its place,
    the round rolls back to step 20 (proven clean by the check after it) and ends 0 with
    the parameters of a fault-free run of 4 ranks."""
    import torch

    from sfharness import launch_run

    ref = tmp_path / "ref"
    ref.mkdir()
    code, _ = launch_run(ref, "--nproc-per-node=4", str(LIBRARY), "--ckpt", str(ref / "ckpt"),
                         "--out", str(ref / "out.pt"), "--steps", STEPS)  # fmt: skip
    assert code == 0
    bed = bed_factory(3)
    ledger = bed.shared / "ledger"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node1:29500", "--rdzv-id", "sdclib", "--max-restarts", "2",
        "--ft-node-ledger", str(ledger),
    ]  # fmt: skip
    script = ["--ckpt", str(bed.shared / "ckpt"), "--out", str(bed.shared / "out.pt"),
              "--steps", STEPS, "--flip", "3:24"]  # fmt: skip
    launches = [bed.launch(n, *flags, script=script, program=LIBRARY) for n in ("node1", "node2")]
    bed.wait_event("workers_started", host="node2")
    launches.append(bed.launch("node3", *flags, script=script, program=LIBRARY))
    bed.wait_event("launcher_start", host="node3")  # a spare, waiting to join
    codes = bed.wait_all(launches, 240)
    assert codes == {"node1": 0, "node2": 74, "node3": 0}, bed.logs()
    (verdict,) = bed.events("sdc_verdict")
    assert (verdict["culprits"], verdict["hosts"], verdict["clean_step"]) == ([3], ["node2"], 20)
    assert [e["cause"] for e in bed.events("node_unhealthy", host="node2")] == ["silent_corruption"]
    assert bed.events("node_joined", node="node3")
    loaded = {(e["host"], e["rank"]): e["step"] for e in bed.events("checkpoint_loaded")}
    assert set(loaded.values()) == {20} and {h for h, _ in loaded} == {"node1", "node3"}
    final = torch.load(bed.shared / "out.pt")
    reference = torch.load(ref / "out.pt")
    assert all(torch.equal(final[k], reference[k]) for k in reference)
