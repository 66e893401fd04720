"""The node ledger as a launcher writes it (steadfast.ledger): real `steadfast launch` runs
on this host, with the ledger in a folder. A run records its node's stint; a failed
health check is a fault against the node, a Python exception is not (the script's); a
node the ledger holds over the site's threshold is refused before it joins (exit 74,
node_unhealthy cause ledger), and the refusal itself is no new fault."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from sfharness import launch_run
from steadfast.ledger import Entry, Fault, FileLedger, Stint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HOST = socket.gethostname()


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(body)
    return path


def _faults(ledger: Path) -> list[Fault]:
    return [f for e in FileLedger(ledger).entries() for f in e.faults]


def test_a_run_records_its_stint_and_only_the_nodes_faults(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    ok = _script(tmp_path, "import time; time.sleep(0.5)\n")
    flags = ["--standalone", "--nproc-per-node=1", f"--ft-node-ledger={ledger}"]
    code, _ = launch_run(tmp_path / "ok", *flags, str(ok))
    assert code == 0
    (entry,) = FileLedger(ledger).entries()
    (stint,) = entry.stints
    assert stint.node == HOST and stint.end - stint.start >= 0.5 and not entry.faults
    bug = _script(tmp_path, "raise RuntimeError('a bug of the script')\n")
    code, _ = launch_run(tmp_path / "bug", *flags, "--max-restarts=0", str(bug))
    assert code == 77
    assert _faults(ledger) == []  # a Python exception is the script's, not the node's
    code, evs = launch_run(tmp_path / "sick", *flags, "--ft-node-health-check=echo bad disk; false",
                           str(ok))  # fmt: skip
    assert code == 74
    (fault,) = _faults(ledger)
    assert (fault.node, fault.cause) == (HOST, "health_check") and "bad disk" in fault.evidence
    assert [e["cause"] for e in evs if e["kind"] == "node_unhealthy"] == ["command"]


def test_a_node_over_the_threshold_is_refused_before_it_joins(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    now = time.time()
    seeded = [
        Fault(HOST, f"job{i}", now - 3600 * i, "node_lost", f"lost in job{i}") for i in (1, 2)
    ]
    FileLedger(ledger).publish(
        "site", Entry("site", [Stint(HOST, "job1", now - 7200, now)], seeded)
    )
    ok = _script(tmp_path, "print('never runs')\n")
    code, evs = launch_run(
        tmp_path / "run", "--standalone", "--nproc-per-node=1", f"--ft-node-ledger={ledger}",
        "--ft-node-ledger-max-faults=2", str(ok),
    )  # fmt: skip
    assert code == 74
    (refused,) = [e for e in evs if e["kind"] == "node_unhealthy"]
    assert refused["cause"] == "ledger" and "2 faults" in refused["reason"]
    assert not [e for e in evs if e["kind"] == "workers_started"]
    assert len(_faults(ledger)) == 2  # the refusal is not a fault of its own
