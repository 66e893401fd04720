"""Lost nodes, for real: launchers on separate nodes (network namespaces, see conftest),
a node killed at once (power loss), cut off (partition) or failing its health check.

Each test checks that the fault was detected (an event naming its cause), that the job
recovered (or, without a spare, ended with the exit status that says why), and, where
the world size is kept, that the final model equals a fault-free run's bit for bit.
Every node runs 2 ranks (the spare test 4, with DDP and with FSDP2). ft_train.py builds
DDP with ``find_unused_parameters=True``, so that a restarted run reduces in the same
bucket layout as one that never stopped (docs/architecture.md, "bit for bit with many
ranks"): the final model equals a fault-free run on the same world size bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import assert_bit_exact
from steadfast.secret import SECRET_FILE_ENV, make_secret_file

pytestmark = pytest.mark.slow

STEPS = 40
SLEEP = "0.2"  # seconds per step: the fault lands mid-run, the run stays short


def job(nnodes: str, *, backend: str = "steadfast", endpoint: str = "node1:29500", nproc: int = 2):
    """The launcher's flags, the same on every node."""
    return [
        "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "lostnodes",
        "--max-restarts", "3",
        "--ft-node-heartbeat-interval", "0.25", "--ft-node-heartbeat-timeout", "2",
    ]  # fmt: skip


def train(bed: Any, *extra: str, steps: int = STEPS) -> list[str]:
    """ft_train.py's arguments: checkpoints and the output on the shared file system."""
    ck, out = bed.shared / "ck", bed.shared / "out.pt"
    return [
        "--ckpt",
        str(ck),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--step-sleep",
        SLEEP,
        *extra,
    ]


def start(bed: Any, flags: list[str], script: list[str], spare: bool = False) -> list[Any]:
    """node1 and node2 start the job; with ``spare``, node3 joins once they train (it
    waits in the rendezvous: the round is full). Their launches, node1 first."""
    launches = [bed.launch(node, *flags, script=script) for node in ("node1", "node2")]
    if spare:
        bed.wait_event("checkpoint_saved", step=2)
        launches.append(bed.launch("node3", *flags, script=script))
    return launches


def saved_steps(bed: Any, host: str, after: float) -> list[int]:
    return [e["step"] for e in bed.events("checkpoint_saved", host=host) if e["time"] > after]


@pytest.mark.parametrize("model", ["ddp", "fsdp"])
def test_a_killed_node_is_replaced_by_a_spare_and_the_run_ends_bit_exact(
    bed_factory, reference, model
):
    """4 ranks per node. node2 is killed (power loss) while a spare waits; the spare
    takes its place. The run also keeps the memory tier
    (``CheckpointManager(memory_every=1)``): every step's snapshot in each node's shared
    memory, replicated to the other node (DDP's replicated state once per node, FSDP2's
    shards per rank), so the spare, which has no snapshot of its own, gets what node1
    keeps for node2's ranks: nothing is read from the disk checkpoint, no step the job
    finished is done again. (The other spare tests below restore from the disk.)"""
    bed = bed_factory(3)
    fsdp = ["--fsdp"] if model == "fsdp" else []
    flags, script = job("2", nproc=4), train(bed, "--memory-every", "1", *fsdp)
    node1, node2, spare = start(bed, flags, script, spare=True)
    bed.wait_event("checkpoint_saved", step=10)
    time.sleep(0.5)  # a few steps past the disk checkpoint (0.2 s each)
    killed = time.time()
    bed.do("kill", "node2")

    lost = bed.wait_event("node_lost", node="node2")
    assert lost["cause"] in ("connection_reset", "silent") and lost["host"] in ("node1", "node3")
    joined = bed.wait_event("node_joined", node="node3")
    assert node1.wait() == 0, bed.logs()
    assert spare.wait() == 0, bed.logs()
    assert node2.wait() != 0
    assert joined["time"] > lost["time"] > killed
    assert len(bed.events("node_lost")) == 1  # one node, reported once
    loaded = [e for e in bed.events("checkpoint_loaded") if e["time"] > killed]
    assert {e["host"] for e in loaded} == {"node1", "node3"} and len(loaded) == 8
    on_spare = [e for e in loaded if e["host"] == "node3"]
    on_node1 = [e for e in loaded if e["host"] == "node1"]
    assert {e["tier"] for e in on_node1} == {"memory"}  # not the disk
    assert {e["tier"] for e in on_spare} == {"replica"}
    node1_ranks = {e["rank"] for e in on_node1}
    assert {e["from_rank"] for e in on_spare} <= node1_ranks  # sent by node1
    on_disk = [e["step"] for e in bed.events("checkpoint_saved") if e["time"] < killed]
    assert len({e["step"] for e in loaded}) == 1  # every rank the same step,
    if loaded[0]["step"] < max(on_disk):  # the one before the newest, re-done to prove
        [proof] = [e for e in bed.events("restore_verified") if e["time"] > killed]
        assert proof["step"] == loaded[0]["step"] and proof["route"] == "state"
        assert proof["against"].endswith(f"step_{max(on_disk)}")
    else:
        assert loaded[0]["step"] >= max(on_disk)  # the newest there is
    assert_bit_exact(bed.shared / "out.pt", reference(STEPS, 8, *fsdp))


@pytest.mark.parametrize("backend", ["steadfast", "steadfast-tls", "etcd-v2"])
def test_the_rendezvous_host_lost_under_etcd_a_spare_takes_its_place(
    etcd_installed, bed_factory, reference, backend, monkeypatch
):
    """The rendezvous lives in an etcd cluster (a member per node): steadfast's through
    etcd's v3 API (``--rdzv-conf store_type=etcd``), torch's etcd-v2 through v2. Losing
    node1, its etcd member with it, whose address every launcher was given under c10d,
    costs nothing but the node. ``steadfast-tls``: the cluster as sites run it, https
    with client certificates required and etcd's auth on (the password from a file),
    and a job with a secret: every record of the rounds, the loss and the spare sealed."""
    bed = bed_factory(3)
    bed.do("etcd", *(["--tls"] if backend == "steadfast-tls" else []))
    rdzv = backend.removesuffix("-tls")
    flags, script = job("2", backend=rdzv, endpoint="127.0.0.1:2379"), train(bed)
    if backend == "steadfast":
        flags += ["--rdzv-conf", "store_type=etcd"]
    if backend == "steadfast-tls":
        monkeypatch.setenv(SECRET_FILE_ENV, str(make_secret_file(bed.shared / "secret")))
        tls = bed.root / "etcd-tls"
        flags += ["--rdzv-conf", f"store_type=etcd,cacert={tls}/ca.pem,cert={tls}/client.pem,"
                  f"key={tls}/client.key,user=root,password_file={tls}/password"]  # fmt: skip
    node1, node2, spare = start(bed, flags, script, spare=True)
    bed.wait_event("checkpoint_saved", step=10)
    killed = time.time()
    bed.do("kill", "node1")

    lost = bed.wait_event("node_lost", node="node1")
    assert lost["host"] in ("node2", "node3")
    bed.wait_event("node_joined", node="node3")
    assert node2.wait() == 0, bed.logs()
    assert spare.wait() == 0, bed.logs()
    assert node1.wait() != 0
    assert {e["host"] for e in bed.events("checkpoint_loaded") if e["time"] > killed} == {
        "node2",
        "node3",
    }
    assert_bit_exact(bed.shared / "out.pt", reference(STEPS))
    assert not bed.events("record_refused")


def test_without_a_spare_the_survivor_exits_75_and_the_retried_job_ends_bit_exact(
    bed_factory, reference
):
    """A fixed-size job that loses a node cannot go on: the survivor waits
    node_lost_timeout for a replacement, then exits 75 (node lost), which the Slurm
    wrapper requeues; here the job is simply started again on the mended nodes."""
    bed = bed_factory(2)
    flags, script = [*job("2"), "--ft-node-lost-timeout", "3"], train(bed)
    node1, node2 = start(bed, flags, script)
    bed.wait_event("checkpoint_saved", step=10)
    bed.do("kill", "node2", "--silent")  # no word on the wire: found by silence

    lost = bed.wait_event("node_lost", node="node2")
    assert lost["cause"] == "silent"
    assert node1.wait() == 75, bed.logs()
    assert node2.wait() != 0

    bed.do("boot", "node2")
    again = [bed.launch(n, *flags, script=script) for n in ("node1", "node2")]
    assert [lc.wait() for lc in again] == [0, 0], bed.logs()
    assert_bit_exact(bed.shared / "out.pt", reference(STEPS))


def test_an_elastic_job_goes_on_with_the_nodes_it_has_and_sees_every_sample_once(bed_factory):
    """--nnodes 1:2: node2 is lost, node1 carries on alone with its two ranks; the data
    position is global, so the rest of the epoch is shared among the ranks that remain
    and the output's `seen` (how often each sample was trained on) is all ones."""
    bed = bed_factory(2)
    flags = [*job("1:2", nproc=2), "--rdzv-conf", "last_call_timeout=1"]
    script = train(bed, "--data", "160", "--batch", "2")
    node1, node2 = start(bed, flags, script)
    # node2 trains too before it is lost: under load its launcher can reach the store
    # more than last_call_timeout after node1 did, and round 0 then forms without it
    # (it joins the next: node1's workers restart for it)
    joined = bed.wait_event("workers_started", host="node2")

    def saved() -> bool:  # a save at step 6 or later of a round node2 is in
        return any(e["time"] > joined["time"] and e["step"] >= 6
                   for e in bed.events("checkpoint_saved"))  # fmt: skip

    deadline = time.monotonic() + 60
    while not saved():
        assert time.monotonic() < deadline, f"no save after node2 joined:\n{bed.logs()}"
        time.sleep(0.1)
    bed.do("kill", "node2")

    bed.wait_event("node_lost", node="node2")
    assert node1.wait() == 0, bed.logs()
    assert node2.wait() != 0
    out = torch.load(bed.shared / "out.pt")
    assert torch.equal(out["seen"], torch.ones(160)), out["seen"]
    assert out["steps"] > 0


def test_a_partitioned_node_is_fenced_off_and_a_spare_takes_its_place(bed_factory, reference):
    """node2's link goes down: node1 finds it by silence, the spare replaces it and the
    run goes on; node2's ranks, cut off from the round, must not write to the shared
    checkpoint directory meanwhile (the fence), and when the link comes back node2 learns
    it was replaced and exits 75 instead of rejoining."""
    bed = bed_factory(3)
    flags, script = job("2"), train(bed)
    node1, node2, spare = start(bed, flags, script, spare=True)
    bed.wait_event("checkpoint_saved", step=10)
    cut = time.time()
    bed.do("partition", "node2")

    lost = bed.wait_event("node_lost", node="node2")
    assert lost["cause"] == "silent" and lost["host"] in ("node1", "node3")
    bed.wait_event("node_joined", node="node3")
    resumed = bed.wait_event("checkpoint_loaded", host="node3")
    bed.wait_event("checkpoint_saved", step=resumed["step"] + 2)  # the new round trains
    bed.do("heal", "node2")
    assert node1.wait() == 0, bed.logs()
    assert spare.wait() == 0, bed.logs()
    assert node2.wait() == 75, bed.logs()
    # node2 found itself cut off, and published nothing once it was (rank 0 publishes;
    # a save under way may finish within the detection window, none may start later);
    # a save that its ranks tried was refused by the fence
    assert bed.events("node_isolated", host="node2"), bed.logs()
    assert not saved_steps(bed, "node2", after=lost["time"])
    assert all(e["host"] == "node2" for e in bed.events("checkpoint_fenced"))
    assert_bit_exact(bed.shared / "out.pt", reference(STEPS))
    assert cut < lost["time"]


def test_a_node_failing_its_health_check_leaves_and_a_spare_takes_its_place(bed_factory, reference):
    """A rank fails and the job restarts; before the next rendezvous every node runs its
    health check. node2's now fails (here a flag file says so), so node2 leaves with exit
    74 and the spare takes its place, instead of the job restarting on a bad node."""
    bed = bed_factory(3)
    flag = bed.shared / "unhealthy"
    check = f'test ! -e {flag}-"$STEADFAST_NODE"'
    flags = [*job("2"), "--ft-node-health-check", check]
    script = train(bed, "--fault", "exception", "--fault-rank", "1", "--fault-step", "14")
    node1, node2, spare = start(bed, flags, script, spare=True)  # both passed their check
    Path(f"{flag}-node2").touch()

    unhealthy = bed.wait_event("node_unhealthy")
    assert unhealthy["host"] == "node2" and unhealthy["cause"] == "command", unhealthy
    bed.wait_event("node_joined", node="node3")
    assert node2.wait() == 74, bed.logs()
    assert node1.wait() == 0, bed.logs()
    assert spare.wait() == 0, bed.logs()
    assert_bit_exact(bed.shared / "out.pt", reference(STEPS))


def _launcher_pid(launch: Any) -> int:
    """The launcher's pid as the host sees it (the node's ``nsenter`` runs it as its
    child)."""
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(launch.proc.pid)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


@pytest.mark.parametrize("model", ["ddp", "fsdp"])
def test_a_killed_rank_then_a_preemption_with_four_ranks_per_node_end_bit_exact(
    bed_factory, reference, model
):
    """2 nodes of 4 ranks. Rank 6 (on node2) is killed: both launchers restart their
    workers from the newest checkpoint. Then the job is preempted: SIGTERM to both
    launchers, every rank agrees on a step and saves it, and the job ends; started again
    it resumes from that step. The final model equals the fault-free 8-rank run's bit for
    bit, with DDP and with FSDP2."""
    import os
    import signal

    bed = bed_factory(2)
    fsdp = ["--fsdp"] if model == "fsdp" else []
    flags = job("2", nproc=4)
    script = train(
        bed, "--fault", "rank_killed", "--fault-rank", "6", "--fault-step", "8", "--graceful",
        *fsdp,
    )  # fmt: skip
    node1, node2 = start(bed, flags, script)
    failed = bed.wait_event("rank_failed", rank=6)
    assert failed["host"] == "node2" and failed["cause"] == "signal SIGKILL"
    resumed = bed.wait_event("checkpoint_loaded", rank=0)
    bed.wait_event("checkpoint_saved", step=resumed["step"] + 4)
    preempted = time.time()
    for launch in (node1, node2):
        os.kill(_launcher_pid(launch), signal.SIGTERM)
    node1.wait(), node2.wait()
    # one step agreed by the 8 ranks, and saved after it (a save of the every-2-steps
    # cadence may also land after the signals were sent: it is not the preemption's)
    [agreed] = [e for e in bed.events("shutdown_agreed") if e["time"] > preempted]
    # counted at the step before the agreed one: the ranks the signals had reached then
    assert 1 <= agreed["ranks_signalled"] <= 8, agreed
    stop = agreed["step"] + 1  # the loop's step index -> the checkpoint's step count
    assert stop < STEPS
    saves = bed.events("checkpoint_saved", step=stop)
    assert [e for e in saves if e["time"] > agreed["time"]], bed.logs()
    done = {e["rank"] for e in bed.events("shutdown_complete") if e["time"] > preempted}
    assert done == set(range(8)), done  # every rank stopped after that step
    again = [bed.launch(n, *flags, script=script) for n in ("node1", "node2")]
    assert [lc.wait() for lc in again] == [0, 0], bed.logs()
    loads = [e for e in bed.events("checkpoint_loaded") if e["time"] > preempted]
    assert len(loads) == 8 and {e["step"] for e in loads} == {stop}
    # the kill struck once (node1's agent names its own first exit too: issue 30)
    assert [e["rank"] for e in bed.events("rank_failed", cause="signal SIGKILL")] == [6]
    assert_bit_exact(bed.shared / "out.pt", reference(STEPS, 8, *fsdp))
