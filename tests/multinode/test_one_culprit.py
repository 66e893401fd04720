"""One culprit per fault, agreed across nodes, in every node's own log (issue 30).

Three nodes of 2 ranks each and a spare, each node writing an event log of its own (as
on a cluster without a shared log). A rank on node2 is killed for real: the peers of
that rank on every node fail in their next collective, and each node's launcher sees
only its own workers go; the nodes agree through the rendezvous store on the one
culprit, so the report of each node's log names node2's rank, and every other rank of
the round is a stop that points to it. Then node3 is killed as a whole (power loss): the
survivors' logs name node3, as a node. The spare takes its place, and the final model
equals a fault-free 6-rank run's bit for bit.
"""

from __future__ import annotations

import time

import pytest
from test_lost_nodes import STEPS, job, train

from sfharness import assert_bit_exact

pytestmark = pytest.mark.slow


def _culprits(bed, host: str) -> list[tuple[str, object, str]]:
    """``(node, culprit rank, what)`` of each fault in the report of ``host``'s own log."""
    from steadfast.report import compute_report, format_report, load_events

    evs, problems = load_events(bed.shared / f"events-{host}.jsonl")
    assert not problems, problems
    report = compute_report(evs)
    assert report.launchers is not None
    text = format_report(report)
    assert "one culprit per fault" in text, text
    return [(f.node, f.rank, f.what) for f in report.launchers.faults]


def test_a_killed_rank_and_a_killed_node_are_each_the_one_culprit_in_every_nodes_log(
    bed_factory, reference
):
    bed = bed_factory(4)
    flags, script = job("3", nproc=2), train(bed)
    nodes = ("node1", "node2", "node3")
    launches = {n: bed.launch(n, *flags, script=script, own_log=True) for n in nodes}
    started = bed.wait_event("workers_started", host="node2")
    victim, pid = started["ranks"][0], started["pids"][0]
    bed.wait_event("checkpoint_saved", step=4)
    spare = bed.launch("node4", *flags, script=script, own_log=True)
    time.sleep(0.5)
    bed.do("run", "node2", "kill", "-KILL", str(pid))  # the rank, on its own node

    # every node of the round names node2's rank, and nothing else, in its own log
    for host in nodes:
        agreed = bed.wait_event("fault_culprit", host=host)
        assert (agreed["node"], agreed["culprit_rank"]) == ("node2", victim), agreed
        assert agreed["cause"] == "signal SIGKILL" and agreed["what"] == "rank failed"
    assert len({e["fault_id"] for e in bed.events("fault_culprit")}) == 1
    assert [(e["host"], e["rank"]) for e in bed.events("rank_failed")] == [("node2", victim)]
    stops = bed.events("rank_stopped")
    assert len(stops) == 5 and {e["first_failed_rank"] for e in stops} == {victim}
    assert {e["culprit_node"] for e in stops} == {"node2"}

    # then node3 as a whole: the survivors name it, as a node; the spare replaces it
    bed.wait_event("checkpoint_saved", step=24)
    killed = time.time()
    bed.do("kill", "node3")
    for host in ("node1", "node2"):
        end = time.monotonic() + 60
        while not [e for e in bed.events("fault_culprit", host=host) if e["time"] > killed]:
            assert time.monotonic() < end, bed.logs()
            time.sleep(0.1)
    second = [e for e in bed.events("fault_culprit") if e["time"] > killed]
    assert {(e["node"], e["culprit_rank"], e["what"]) for e in second} == {
        ("node3", None, "node lost")
    }
    assert [launches[n].wait() for n in ("node1", "node2")] == [0, 0], bed.logs()
    assert spare.wait() == 0, bed.logs()
    assert bed.events("node_joined", node="node4")

    # the report of each node's own log
    first = ("node2", victim, "rank failed")
    lost = ("node3", None, "node lost")
    assert _culprits(bed, "node1") == [first, lost]
    assert _culprits(bed, "node2") == [first, lost]
    assert _culprits(bed, "node3")[0] == first  # its log ends with the node
    assert_bit_exact(bed.shared / "out.pt", reference(STEPS, 6))
