"""A plain torchrun script (``plain_ddp.py``: no steadfast import, its own snapshot.pt)
under ``steadfast launch`` on the bed: what a user switching from torchrun brings.

Each run checks what such a user can see: the launchers' exit codes, that every epoch
ran (the script's own per-epoch lines), that each launcher ended soon after its node's
last worker (none left waiting in torch's exit barrier), and the fault in the log.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from steadfast.secret import SECRET_FILE_ENV, make_secret_file

pytestmark = pytest.mark.slow

PLAIN = Path(__file__).with_name("plain_ddp.py")
EPOCHS = int(os.environ.get("PLAIN_EPOCHS", "30"))
KILL_AT = int(os.environ.get("PLAIN_KILL_AT", "8"))
#: A launcher that waited for a node that cannot come (issue 36) waits for a timeout:
#: job_end_timeout (60 s by default) or the rendezvous's. One that waited for none ends
#: a fraction of a second after the last worker when the machine is idle (the figure is
#: bench/bench_launcher_end.py's), and ~2 s at worst under the soak's load (torch's c10d
#: rendezvous polls every second). The bound tells the two apart under any load; how soon
#: is the bench's to say, not a test's.
END_WITHIN = float(os.environ.get("PLAIN_END_WITHIN", "10.0"))


def job(nnodes: str, *, backend: str = "steadfast", endpoint: str = "node1:29500") -> list[str]:
    return [
        "--nnodes", nnodes, "--nproc-per-node", "2",
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "plain",
        "--max-restarts", "3",
    ]  # fmt: skip


#: where a held first run waits until :func:`release` (the tests kill before it)
HOLD_AT = EPOCHS - 9


def script(bed: Any, hold: bool = False) -> list[str]:
    """The script's arguments; with ``hold``, the first run waits before epoch
    :data:`HOLD_AT` until :func:`release`: a fault the test makes lands mid-run, however
    loaded the machine (under load the last epochs once ran out before a kill landed:
    the spare then waited for a round that never came). A run restarted from the
    snapshot does not wait."""
    held = []
    if hold:
        (bed.shared / "hold").touch()
        held = ["--hold", str(bed.shared / "hold"), "--hold-at", str(HOLD_AT)]
    return [
        "--snapshot", str(bed.shared / "snapshot.pt"), "--epochs", str(EPOCHS),
        "--epoch-sleep", os.environ.get("PLAIN_SLEEP", "0.2"), "--out", str(bed.shared / "out.pt"),
        "--trace", str(bed.shared / "trace"), *held,
    ]  # fmt: skip


def release(bed: Any) -> None:
    """Let a job started with ``script(bed, hold=True)`` end."""
    (bed.shared / "hold").unlink(missing_ok=True)


def trace(bed: Any) -> list[dict[str, Any]]:
    """Every line the script's ranks wrote: epochs and ends, with their file's name."""
    lines = []
    folder = bed.shared / "trace"
    for f in sorted(folder.iterdir()) if folder.exists() else []:
        for line in f.read_text().splitlines():
            words = line.split()
            if len(words) % 2 or not words:
                continue  # a line being written
            rec: dict[str, Any] = dict(zip(words[::2], words[1::2], strict=True))
            rec["file"] = f.name
            lines.append(rec)
    return lines


def wait_epoch(bed: Any, epoch: int, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while not any(r.get("epoch") == str(epoch) for r in trace(bed)):
        if time.monotonic() > end:
            pytest.fail(f"epoch {epoch} never ran:\n{bed.logs()}")
        time.sleep(0.05)


def last_epoch(bed: Any) -> int:
    """The last epoch any rank has written so far."""
    return max((int(r["epoch"]) for r in trace(bed) if "epoch" in r), default=0)


def assert_every_epoch_ran_and_launchers_ended(bed: Any, launches: list[Any]) -> None:
    lines = trace(bed)
    ran = {int(r["epoch"]) for r in lines if "epoch" in r}
    assert ran == set(range(EPOCHS)), sorted(set(range(EPOCHS)) - ran)
    assert (bed.shared / "out.pt").exists()
    # each launcher heard every node of its round finish, and ended soon after the job's
    # last worker exited: it waited for no node that could not come. From the exit, not
    # the script's last line: a worker's end is its interpreter's teardown (about 1 s for
    # a torch process, as under torchrun)
    exits = [
        float(x["time"])
        for e in bed.events("workers_exited")
        if e["cause"] == "succeeded"
        for x in e["exits"]
    ]
    for lc in launches:
        done = [float(r["time"]) for r in lines if "done" in r and r["host"] == lc.node]
        if not done or lc.proc.returncode != 0:
            continue
        assert lc.ended is not None and exits
        barrier = bed.events("exit_barrier", host=lc.node)
        assert [(e["cause"], e["missing"], e["lost"]) for e in barrier] == [
            ("all_finished", [], [])
        ], barrier
        late = lc.ended - max(exits)
        assert late <= END_WITHIN, f"{lc.node}'s launcher ended {late:.1f}s after the last worker"


#: how many times each spare scenario runs: two by default (a scenario that fails one
#: run in five then fails a run of the suite 36 % of the time: 1 - 0.8^2, within the
#: suite's time); bench/bench_job_end_nodes.py measures 20 runs of each
REPEAT = int(os.environ.get("PLAIN_REPEAT", "2"))


def assert_every_launcher_left_the_barrier_together(bed: Any, hosts: list[str]) -> None:
    """Each finishing launcher wrote ``exit_barrier`` and heard every other node finish:
    none waited out its bound for a node that could not come (issue 36)."""
    left = {e["host"]: e for e in bed.events("exit_barrier")}
    assert sorted(left) == sorted(hosts), left
    for host, e in left.items():
        assert e["cause"] == "all_finished" and e["missing"] == [], (host, e)


@pytest.mark.parametrize("attempt", range(REPEAT))
@pytest.mark.parametrize("arrival", ["before_the_loss", "after_the_loss"])
@pytest.mark.parametrize("backend", ["c10d", "steadfast"])
def test_a_spare_replaces_a_killed_node_and_every_launcher_ends(
    bed_factory, backend, arrival, attempt, monkeypatch
):
    """3 nodes and a spare, on torch's c10d rendezvous (the torchrun command line) and on
    steadfast's own; the spare comes while the round runs (it waits on the redundancy
    list) or only after node2 was killed. The new round (node1, node3, node4) trains to
    the end; every launcher, the spare's and the store host's included, ends within 2 s
    of its worker with exit 0, each heard every other node finish (issue 36: under
    c10d the survivors waited for the spare in 4 runs of 6), and the spare's
    ``workers_exited`` is in the log. The job has a secret, as every ``steadfast slurm``
    job does: under c10d too the roster's records of both rounds are sealed, and none is
    refused."""
    bed = bed_factory(4)
    monkeypatch.setenv(SECRET_FILE_ENV, str(make_secret_file(bed.shared / "secret")))
    flags, args = job("3", backend=backend), script(bed, hold=True)
    launches = [
        bed.launch(n, *flags, script=args, program=PLAIN) for n in ("node1", "node2", "node3")
    ]
    wait_epoch(bed, 1)
    if arrival == "before_the_loss":  # long before: waiting to join when node2 goes
        launches.append(bed.launch("node4", *flags, script=args, program=PLAIN))
        bed.wait_event("launcher_start", host="node4")  # torch imported, joining next
        wait_epoch(bed, min(last_epoch(bed) + 8, EPOCHS - 10))
        bed.do("kill", "node2")
    else:
        wait_epoch(bed, KILL_AT)
        bed.do("kill", "node2")
        bed.wait_event("node_lost", node="node2")
        launches.append(bed.launch("node4", *flags, script=args, program=PLAIN))
    bed.wait_event("node_joined", node="node4")
    release(bed)
    codes = bed.wait_all(launches)
    assert codes["node1"] == codes["node3"] == codes["node4"] == 0, bed.logs()
    assert codes["node2"] != 0
    lost = bed.events("node_lost", node="node2")
    assert len(lost) == 1, lost
    assert bed.events("node_joined", node="node4")
    survivors = [lc for lc in launches if lc.node != "node2"]
    assert_every_epoch_ran_and_launchers_ended(bed, survivors)
    assert_every_launcher_left_the_barrier_together(bed, ["node1", "node3", "node4"])
    (spare_end,) = bed.events("workers_exited", host="node4")
    assert spare_end["cause"] == "succeeded"
    assert os.path.getsize(bed.shared / "out.pt") > 0
    assert_the_report_tells_the_launchers_story(bed, lost[0], backend)
    assert not bed.events("record_refused")


@pytest.mark.parametrize("watch", ["true", "false"])
def test_a_rank_that_outlives_the_jobs_end_is_ended_and_no_launcher_waits_for_it(
    bed_factory, watch
):
    """2 nodes; node2's ranks never end after their last epoch (asleep before their
    destroy_process_group()). node1 finishes, waits in the exit barrier at most
    job_end_timeout and leaves naming node2 (exit 0: its work is done); node2 heard
    node1 finish, and job_end_timeout later looks at its ranks: the job's last
    collective is behind them, they do not move, so they are torn down (issue 68:
    ``worker_teardown``, exit 0, never trained again). Where progress is not watched no
    look can tell: it takes them for hung at the job's end (``rank_hung``, cause
    ``job_end``), stops them and exits 79. No launcher waits for a node that cannot
    come (issue 36)."""
    bed = bed_factory(2)
    flags = [
        *job("2", backend="c10d"), "--ft-job-end-timeout", "3", "--ft-watch-progress", watch
    ]  # fmt: skip
    args = [*script(bed), "--hang-at-end-on", "node2"]
    launches = [bed.launch(n, *flags, script=args, program=PLAIN) for n in ("node1", "node2")]
    codes = bed.wait_all(launches, timeout=120)
    from steadfast.report import compute_report, format_report, load_events

    if watch == "true":
        assert codes == {"node1": 0, "node2": 0}, bed.logs()
        torn = bed.events("worker_teardown", host="node2")
        assert {e["rank"] for e in torn} == {2, 3}, torn
        assert {e["cause"] for e in torn} == {"hung"} and all(e["after"] >= 3 for e in torn)
        assert not bed.events("rank_hung") and not bed.events("rank_failed")
        assert len(bed.events("workers_started", host="node2")) == 1  # never trained again
        (ended,) = bed.events("workers_exited", host="node2")
        assert ended["cause"] == "succeeded"
        return
    assert codes == {"node1": 0, "node2": 79}, bed.logs()
    hung = bed.events("rank_hung", host="node2")
    assert {e["rank"] for e in hung} == {2, 3} and {e["cause"] for e in hung} == {"job_end"}
    assert all(e["elapsed"] >= 3 for e in hung)
    # the ranks were alive, asleep in the kernel: not an exit the launcher missed
    assert {e["process"] for e in hung} == {"running"} and all(e["wchan"] for e in hung)
    # node1 left at its bound naming node2, or heard node2 say goodbye once it had
    # stopped its hung ranks (the two bounds end together): never a wait beyond them
    (left,) = bed.events("exit_barrier", host="node1")
    if left["cause"] == "timeout":
        assert left["missing"] == ["node2"], left
    else:
        assert left["time"] >= max(e["time"] for e in hung), (left, hung)
    assert left["waited"] < 3 + 5, left
    (stopped,) = bed.events("workers_exited", host="node2")
    assert stopped["cause"] == "stopped"
    evs, problems = load_events(bed.shared)
    text = format_report(compute_report(evs, problems))
    assert "rank hung" in text and "node2" in text and "NO END" not in text


def assert_the_report_tells_the_launchers_story(
    bed: Any, lost: dict[str, Any], backend: str = "steadfast"
) -> None:
    """`steadfast report` on the shared run directory, checked against the launchers'
    own events: the true wall time, the two generations, the loss (node, cause, its
    detection latency, the time to the next generation, the spare), the wall time split,
    and the steps and goodput the launchers saw; and the timeline by node."""
    from steadfast.report import compute_report, format_report, load_events, plot_timeline

    evs, problems = load_events(bed.shared)
    report = compute_report(evs, problems)
    raw = bed.events()
    # the wall time from the first launcher process's start (its imports are start-up)
    starts = [e.get("process_start") or e["time"] for e in raw if e["kind"] == "launcher_start"]
    ends = [e["time"] for e in raw if e["kind"] == "launcher_end"]
    assert len(starts) == 4 and len(ends) == 3  # node2's launcher died with its node
    assert report.wall_time == pytest.approx(max(ends) - min(starts), abs=1e-6)
    view = report.launchers
    assert view is not None and report.reports_steps  # the steps its launchers saw
    # by node rank (the first round's by arrival): steadfast's rendezvous gives the spare
    # the lost node's seat, and the survivors keep theirs; torch's sorts them again
    first, second = (g.nodes for g in view.generations)
    assert sorted(first) == ["node1", "node2", "node3"]
    if backend == "steadfast":
        assert second == ["node4" if n == "node2" else n for n in first]
    else:
        assert sorted(second) == ["node1", "node3", "node4"]
    # the first ended when node2 went: stopped by the launchers, or failed on their own
    # when a collective lost its peer before the roster stopped them
    assert view.generations[0].outcome in ("stopped", "failed")
    assert view.generations[1].outcome == "succeeded"
    assert report.generations == 2 and report.restarts == 1
    (fault,) = view.faults
    assert (fault.what, fault.node, fault.cause) == ("node lost", "node2", lost["cause"])
    assert fault.detection_latency == pytest.approx(lost["latency"])
    started_again = [
        e["time"] for e in raw if e["kind"] == "workers_started" and e["time"] > lost["time"]
    ]
    assert len(started_again) == 3
    assert fault.next_generation == pytest.approx(max(started_again) - lost["time"])
    assert fault.replaced_by == ["node4"]
    split = view.startup + view.running + view.lost + view.ending
    assert split == pytest.approx(report.wall_time, abs=0.5)  # a fault's windows overlap
    text = format_report(report)
    assert "goodput" in text and "steps kept" in text  # with no line of steadfast
    assert "node lost      node2" in text and "node4" in text
    assert "verdict: 1 fault(s) seen, each followed by a new generation" in text
    # the restart, phase by phase: the survivors' (the spare's round is its first), from
    # the loss to the first epoch's first iteration again, every second in one phase
    (restart,) = report.restarts_phases
    assert restart["kind"] == "in-job" and "node2" in restart["what"], restart
    assert sorted(n["host"] for n in restart["nodes"]) == ["node1", "node3"], restart
    phases = restart["phases"]
    assert sum(phases.values()) == pytest.approx(restart["seconds"], abs=1e-3), phases
    for name in ("detection", "rendezvous", "process_start", "init_process_group", "first_step"):
        assert phases[name] > 0, (name, phases)
    # its restore is its own (torch.load, no CheckpointManager): said to be unproven
    assert "restarts, fault to first step (1; restores proven: 0 of 1" in text
    assert "restore: not verified (no restore_verified" in text
    picture = plot_timeline(evs, bed.root / "timeline.png")
    assert picture.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("fault", "backend"),
    [
        ("silent_kill", "c10d"),
        ("silent_kill", "steadfast"),
        ("partition", "c10d"),
        ("partition", "steadfast"),
        ("etcd_host_lost", "etcd-v2"),
    ],
)
def test_a_plain_script_survives_a_lost_node_with_a_spare(bed_factory, fault, backend, request):
    """The lost-node matrix with the plain script, on torch's c10d rendezvous (what a
    torchrun command line names) and on steadfast's own (a killed node: the spare test
    above, on both): 2 nodes and a spare, one node lost silently (power and link gone at
    once), cut off by a partition (it learns it was replaced when the link returns, and
    exits 75), or the rendezvous host (node1) lost under etcd. The job goes on with the
    spare to the end, every epoch runs, and the launchers that finish end within 2 s of
    their workers."""
    if fault == "etcd_host_lost":
        request.getfixturevalue("etcd_installed")
    bed = bed_factory(3)
    if fault == "etcd_host_lost":
        bed.do("etcd")
        flags, victim = job("2", backend=backend, endpoint="127.0.0.1:2379"), "node1"
    else:
        flags, victim = job("2", backend=backend), "node2"
    flags = [*flags, "--ft-node-heartbeat-interval", "0.25", "--ft-node-heartbeat-timeout", "2"]
    args = script(bed, hold=True)
    launches = [bed.launch(n, *flags, script=args, program=PLAIN) for n in ("node1", "node2")]
    wait_epoch(bed, 0)
    launches.append(bed.launch("node3", *flags, script=args, program=PLAIN))
    wait_epoch(bed, KILL_AT)
    if fault == "partition":
        bed.do("partition", victim)
    else:
        bed.do("kill", victim, *(["--silent"] if fault == "silent_kill" else []))
    lost = bed.wait_event("node_lost", node=victim)
    if fault == "partition":
        bed.wait_event("node_joined", node="node3")
        wait_epoch(bed, KILL_AT + 3)  # the new round trains
        bed.do("heal", victim)
    bed.wait_event("node_joined", node="node3")
    release(bed)
    codes = bed.wait_all(launches)
    survivors = [lc for lc in launches if lc.node != victim]
    assert [codes[lc.node] for lc in survivors] == [0, 0], bed.logs()
    if fault == "partition":  # back, it found itself replaced
        assert codes[victim] == 75, bed.logs()
    else:  # killed with its node
        assert codes[victim] != 0
    # a silent loss is found by the missing beats; a killed launcher's connections reset
    assert lost["cause"] == ("connection_reset" if fault == "etcd_host_lost" else "silent"), lost
    assert len(bed.events("node_lost")) == 1
    assert bed.events("node_joined", node="node3")
    assert_every_epoch_ran_and_launchers_ended(bed, survivors)


def test_under_c10d_the_lost_store_host_ends_every_survivor_with_75(bed_factory):
    """Under torch's c10d rendezvous the store lives in the endpoint host's launcher
    (node1): with that node lost there is no store left to form a round in, spare or
    not. The expected outcome, written down: every survivor exits 75 within
    node_lost_timeout of the loss: node2 cut off from its peer and the store at once,
    and the spare node3, waiting to join, its store gone after it answered; none waits
    out a rendezvous or barrier timeout. With job retries under Slurm the job is
    requeued instead (78, or Slurm's own requeue where the batch host went:
    tests/slurm). etcd keeps its store (the matrix above), and so does steadfast's
    rendezvous on etcd (test_lost_nodes)."""
    bed = bed_factory(3)
    lost_timeout = 10
    flags = [*job("2", backend="c10d"), "--ft-node-lost-timeout", str(lost_timeout)]
    args = script(bed, hold=True)  # never released: the survivors end with 75
    launches = [bed.launch(n, *flags, script=args, program=PLAIN) for n in ("node1", "node2")]
    wait_epoch(bed, 0)
    launches.append(bed.launch("node3", *flags, script=args, program=PLAIN))
    bed.wait_event("launcher_start", host="node3")  # torch imported, joining next
    wait_epoch(bed, min(last_epoch(bed) + 8, EPOCHS - 10))  # waiting to join by now
    killed = time.time()
    bed.do("kill", "node1")
    survivors = launches[1:]
    codes = bed.wait_all(survivors, timeout=lost_timeout + 60)
    assert codes == {"node2": 75, "node3": 75}, bed.logs()
    for lc in survivors:
        assert lc.ended is not None and lc.ended - killed < lost_timeout + 5, (lc.node, bed.logs())
    ends = {e["host"]: e["exit_code"] for e in bed.events("launcher_end")}
    assert ends["node2"] == ends["node3"] == 75
    (isolated,) = bed.events("node_isolated", host="node2")
    assert isolated["cause"] == "partition" and "rendezvous store" in isolated["how"]


def test_a_frozen_rank_on_node2_is_the_one_agreed_culprit_in_every_nodes_log(bed_factory):
    """3 nodes on c10d (the torchrun command line), each with a log of its own, no
    --ft-* flag: a rank of node2 is SIGSTOPped mid-run. Its peers on every node wait in
    DDP's all-reduce; node1 and node3 see nothing move but no culprit of their own and
    wait, node2 sees its rank stopped, names it and ends it (issue 37). Every node's log
    and report name node2's rank as the one culprit; the job restarts from the script's
    snapshot and every epoch runs."""
    bed = bed_factory(3)
    flags, args = job("3", backend="c10d"), script(bed, hold=True)
    nodes = ("node1", "node2", "node3")
    launches = [bed.launch(n, *flags, script=args, program=PLAIN, own_log=True) for n in nodes]
    started = bed.wait_event("workers_started", host="node2")
    victim, pid = started["ranks"][1], started["pids"][1]
    wait_epoch(bed, KILL_AT)
    bed.do("run", "node2", "kill", "-STOP", str(pid))
    stopped = time.time()
    bed.wait_event("hang_confirmed")
    release(bed)
    codes = bed.wait_all(launches)
    assert codes == dict.fromkeys(nodes, 0), bed.logs()
    [confirmed] = bed.events("hang_confirmed")
    assert confirmed["host"] == "node2" and confirmed["culprit"] == victim, confirmed
    assert confirmed["where"] == "stopped (state T)"
    [hung] = bed.events("rank_hung")
    assert (hung["host"], hung["rank"]) == ("node2", victim)
    assert hung["time"] - stopped <= 10.0, hung["time"] - stopped
    for host in nodes:
        [agreed] = bed.events("fault_culprit", host=host)
        assert (agreed["node"], agreed["culprit_rank"]) == ("node2", victim), agreed
        assert agreed["what"] == "rank hung", agreed
    assert_every_epoch_ran_and_launchers_ended(bed, launches)

    from steadfast.report import compute_report, format_report, load_events

    for host in nodes:
        evs, _ = load_events(bed.shared / f"events-{host}.jsonl")
        report = compute_report(evs)
        assert report.launchers is not None
        assert [(f.node, f.rank, f.what) for f in report.launchers.faults] == [
            ("node2", victim, "rank hung")
        ]
        if host == "node2":
            assert f"rank {victim} (node2) stopped (state T)" in format_report(report)
