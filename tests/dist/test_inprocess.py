"""In-process restart with real gloo groups, real signals and real hangs (2-3 processes).

Every rank runs a small data-parallel training loop under ``Wrapper``; the training state
is kept in memory across iterations (a snapshot after every step). Each fault test checks
the three things: the fault was detected (an event naming its cause and rank), the run
recovered (every surviving rank finished, in iteration >= 1), and the final parameters
equal bit for bit those of a fault-free run with the same schedule of world sizes,
computed first in the same processes with plain gloo groups.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sfharness import Ranks, children, read_events, socket_count, suite_shm, wait_for
from steadfast.faults import InjectedFault, fail_at
from steadfast.inprocess import (
    CallWrapper,
    InterruptedIteration,
    RestartAbort,
    RetryController,
    ShiftRanks,
    Wrapper,
)

STEPS = 8
FAULT_STEP = 3
PG_TIMEOUT = datetime.timedelta(seconds=120)  # far longer than any restart may take


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# -- the training loop --------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the global batch of ``step`` (12 samples, split by world)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, 6, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    shard = torch.arange(12)[rank::world]
    return x[shard], y[shard]


def _step(model: torch.nn.Module, step: int, rank: int, world: int) -> None:
    x, y = _batch(step, rank, world)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p -= 0.05 * p.grad / world


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _reference(
    rank: int, workdir: Path, schedule: list[tuple[int, int, dict[int, int]]], tag: str = ""
) -> Any:
    """Fault-free run: for each ``(world, until_step, {initial rank: rank})`` phase, the
    ranks in the map train with a plain gloo group of that world size."""
    model, start = _model(), 0
    for phase, (world, until, ranks) in enumerate(schedule):
        if rank in ranks:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{workdir}/ref_store{tag}_{phase}",
                rank=ranks[rank],
                world_size=world,
                timeout=PG_TIMEOUT,
            )
            for step in range(start, until):
                _step(model, step, ranks[rank], world)
            dist.destroy_process_group()
        start = until
    return _params(model)


def _planned_fault(plan: dict[str, Any], cw: CallWrapper) -> InjectedFault | None:
    """This iteration's fault (``fail_at``, fresh each iteration up to
    ``max_fault_iteration``). ``plan["kind"]`` is a FaultKind; ``lost`` (a rank_killed
    that takes the rank's monitor process with it, as a lost node does) and ``freeze``
    (a rank_hung by SIGSTOP) are the variants these tests add."""
    if cw.iteration > plan.get("max_fault_iteration", 0):
        return None
    return fail_at(
        plan["rank"],
        plan.get("step", FAULT_STEP),
        plan["kind"],
        freeze=plan.get("freeze", False),
    )


def _strike(fault: InjectedFault | None, plan: dict[str, Any], rank: int, step: int) -> None:
    if fault is None:
        return
    if plan.get("lost") and (rank, step) == (fault.rank, fault.step):
        for child in children(os.getpid(), zombies=True):  # its monitor process first
            os.kill(child, signal.SIGKILL)
    fault.check(step, rank)


def inproc_train(
    rank: int, world: int, workdir: Path, plan: dict[str, Any], schedule: Any
) -> dict[str, Any]:
    """One rank: the fault-free reference, then the run under the Wrapper with ``plan``.
    ``schedule``: the reference's phases, or {the step the restarted ranks agree to
    start from: its phases}, one reference each (the world changes at that step)."""
    schedules = schedule if isinstance(schedule, dict) else {None: schedule}
    references = {
        start: _reference(rank, workdir, phases, f"_{start}" if start is not None else "")
        for start, phases in (schedules.items() if schedule else [])
    }
    kwargs: dict[str, Any] = dict(
        soft_timeout=_td(plan.get("soft", 20)),
        hard_timeout=_td(plan.get("hard", 30)),
        barrier_timeout=_td(60),
        heartbeat_timeout=_td(plan.get("heartbeat", 10)),
        heartbeat_interval=_td(0.1),
        monitor_thread_interval=_td(0.1),
        monitor_process_interval=_td(0.1),
        progress_watchdog_interval=_td(0.1),
        termination_grace_time=_td(0.5),
        last_call_wait=_td(0.5),
        rank_assignment=ShiftRanks(),
        monitor_process_logfile=str(workdir / "monitor_{rank}.log"),
    )
    if "max_iterations" in plan:
        kwargs["initialize"] = RetryController(max_iterations=plan["max_iterations"])
    # survives iterations: this step's state and the one before (see _agree_on_the_step)
    memory: dict[str, Any] = {"step": 0, "params": _params(_model()), "prev": None}
    seen: dict[str, Any] = {"iterations": [], "ranks": [], "starts": []}

    @Wrapper(**kwargs)
    def train(plan: dict[str, Any], call_wrapper: CallWrapper | None = None) -> Any:
        assert call_wrapper is not None
        cw = call_wrapper
        r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        seen["iterations"].append(cw.iteration)
        seen["ranks"].append((r, w))
        dist.init_process_group("gloo", store=cw.store, rank=r, world_size=w, timeout=PG_TIMEOUT)
        fault = _planned_fault(plan, cw)
        model = _model()
        tier = None
        if plan.get("memory_tier"):  # the state kept by CheckpointManager's memory tier
            from steadfast import CheckpointManager

            tier = CheckpointManager(workdir / "ck", memory_every=1)
            restored = tier.restore({"model": model})
            memory["step"] = restored[0] if restored else 0
        else:
            seen["starts"].append(_agree_on_the_step(memory))
            with torch.no_grad():
                for p, saved in zip(model.parameters(), memory["params"], strict=True):
                    p.copy_(saved)
        for step in range(memory["step"], STEPS):
            at_fault = cw.iteration == 0 and step == FAULT_STEP
            if at_fault and rank in plan.get("late", {}):
                time.sleep(plan["late"][rank])  # this rank's last progress comes later
            cw.ping()
            if plan.get("atomic") and rank == 0 and cw.iteration == 0 and step == FAULT_STEP:
                _atomic_probe(cw, workdir)
            if plan.get("atomic") and rank == 1 and cw.iteration == 0 and step == FAULT_STEP:
                wait_for((workdir / "atomic_entered").exists, 30, "rank 0 in atomic()")
            _strike(fault, plan, rank, step)
            if at_fault and rank in plan.get("linger", {}):
                _run_python_for(plan["linger"][rank])  # after its ping, before it blocks
            _step(model, step, r, w)
            if plan.get("late_snapshot") and rank == 0 and cw.iteration == 0 and step == 2:
                while True:  # descheduled between its last collective and its snapshot,
                    time.sleep(0.01)  # until the interruption lands here
            with cw.atomic():  # never half a snapshot
                memory["prev"] = (memory["step"], memory["params"])
                memory["step"], memory["params"] = step + 1, _params(model)
            if tier is not None:  # where the interruption may land: before, in or after
                if cw.iteration == 0:
                    seen["snapshot_called"] = step + 1
                tier.snapshot(step + 1, {"model": model})
                if cw.iteration == 0:
                    seen["snapshot_returned"] = step + 1
        if tier is not None:
            tier.close()
        dist.destroy_process_group()
        return _params(model)

    sockets_before = socket_count()
    try:
        params = train(plan)
        error = None
    except RestartAbort as exc:
        params, error = None, "\n".join([str(exc), *getattr(exc, "__notes__", [])])
    restarted_at = seen["starts"][-1] if len(seen["starts"]) > 1 else None
    return {
        "params": params,
        "reference": references.get(restarted_at, references.get(None)),
        "error": error,
        "seen": seen,
        "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
        "children": sorted(children(os.getpid(), zombies=True)),
        "sockets_left": socket_count() - sockets_before,
        "dist_initialized": dist.is_initialized(),
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
    }


def _agree_on_the_step(memory: dict[str, Any]) -> int:
    """The step every rank resumes from: the oldest any rank holds.

    State kept by hand is rank-local, and the interruption lands at any bytecode: a rank
    interrupted between its step's last collective and its snapshot holds the step
    before, while its peers, whose collective completed too, hold the step. Each rank
    keeps the step before as well and all take the older one (a rank can be at most one
    step ahead: the next step's collective needs the rank that is behind). Without it
    the ranks run different steps against each other, and the one ahead finishes and
    leaves while the other still needs it: a restart without end (docs/guides/inprocess)."""
    mine = torch.tensor([memory["step"]])
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    agreed = int(mine.item())
    if agreed != memory["step"]:
        assert memory["prev"] is not None and memory["prev"][0] == agreed, (agreed, memory)
        memory["step"], memory["params"] = memory["prev"]
    return agreed


def _run_python_for(seconds: float) -> None:
    """Run bytecode (the progress count moves) for ``seconds``, without a ping."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


def _atomic_probe(cw: CallWrapper, workdir: Path) -> None:
    """Rank 0 holds ``atomic()`` for ~1 s while rank 1 raises; the interruption must wait."""
    with cw.atomic():
        (workdir / "atomic_entered").write_text(str(time.time()))
        for _ in range(100):  # 100 bytecode boundaries where an interruption could land
            time.sleep(0.01)
        (workdir / "atomic_left").write_text(str(time.time()))
    try:
        while True:
            time.sleep(0.01)
    except InterruptedIteration:
        (workdir / "interrupted_at").write_text(str(time.time()))
        raise


# -- helpers ------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    with socket.socket() as s:  # the Wrapper's store goes on MASTER_PORT + 1
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"SFHARNESS_NO_INIT": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1)}


def _run(tmp_path: Path, world: int, plan: dict[str, Any], schedule: Any) -> tuple[Ranks, list]:
    ranks = Ranks(inproc_train, tmp_path, world, (plan, schedule), _env())
    try:
        codes = ranks.wait(100)  # below pytest's 120 s: a hang ends with the ranks' stacks
    except TimeoutError as exc:  # and with what the ranks and their monitors last said
        raise TimeoutError(f"{exc}\n{_last_words(tmp_path)}") from None
    return ranks, codes


def _last_words(workdir: Path) -> str:
    """The tails of the run's event log and of its monitor processes' logs."""
    parts = []
    if (workdir / "events.jsonl").exists():
        counts = Counter(
            (e["kind"], e.get("cause"), e.get("rank"))
            for e in read_events(workdir / "events.jsonl")
        )
        parts.append(f"--- events by (kind, cause, rank): {sorted(counts.items(), key=str)}")
    for path in [workdir / "events.jsonl", *sorted(workdir.glob("monitor_*.log"))]:
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()
            parts.append(f"--- {path.name} (last 40 of {len(lines)} lines) ---")
            parts.extend(line[:300] for line in lines[-40:])
    return "\n".join(parts)


def _result(tmp_path: Path, rank: int) -> dict[str, Any]:
    import pickle

    status, value = pickle.loads((tmp_path / f"result_{rank}.pkl").read_bytes())
    assert status == "ok", f"rank {rank} failed:\n{value}"
    return value  # type: ignore[no-any-return]


def _assert_clean(res: dict[str, Any]) -> None:
    """After the Wrapper returned: no thread, process, socket or group of its is left,
    and RANK/WORLD_SIZE are the caller's again."""
    assert res["threads"] == []
    assert res["children"] == []
    assert res["sockets_left"] <= 0
    assert not res["dist_initialized"]


def _assert_bit_exact(res: dict[str, Any]) -> None:
    assert res["params"] is not None and res["reference"] is not None
    for got, want in zip(res["params"], res["reference"], strict=True):
        assert torch.equal(got, want), "parameters differ from the fault-free run"


def _no_monitor_left(event_log: Path) -> bool:
    """No monitor process of this test's run is alive: none holds the test's event log
    open (a monitor opens it with its first event, and every monitor that reports a
    fault has written one; a neighbour job's monitors hold their own)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
                if not comm.startswith("sf-monitor"):
                    continue
                fds = os.listdir(f"/proc/{entry}/fd")
                ours = any(_link(f"/proc/{entry}/fd/{fd}") == str(event_log) for fd in fds)
            except OSError:
                continue
            if ours:
                return False
    return True


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _events(event_log: Path) -> list[dict[str, Any]]:
    """The run's events, once its monitor processes, which write some of them (a rank's
    termination after its death is confirmed), have exited."""
    wait_for(lambda: _no_monitor_left(event_log), 10, "monitor processes to exit")
    return read_events(event_log)


def _kinds(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind]


# -- the tests ----------------------------------------------------------------------------
def test_exception_on_one_rank_restarts_every_rank(tmp_path: Path, event_log: Path) -> None:
    full = [(2, STEPS, {0: 0, 1: 1})]
    _, codes = _run(tmp_path, 2, {"kind": "exception", "rank": 1}, full)
    assert codes == [0, 0]
    results = [_result(tmp_path, r) for r in range(2)]
    evs = _events(event_log)
    # detected: rank 1's own exception, with its message
    faults = [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "exception"]
    assert [(e["fault_rank"], e["iteration"]) for e in faults] == [(1, 0)]
    assert "injected fault on rank 1" in faults[0]["detail"]
    # recovered: both ranks ran iteration 1 (same ranks) and finished bit-exact
    restarts = _kinds(evs, "inprocess_restart")
    assert sorted(e["rank"] for e in restarts) == [0, 1]
    for e in restarts:
        assert e["iteration"] == 1 and e["world_size"] == 2 and e["cause"] == "exception"
        # rank 0 was blocked in an all-reduce with a 120 s timeout: the abort released it
        assert e["seconds"] < PG_TIMEOUT.total_seconds() / 4
    for r, res in enumerate(results):
        assert res["seen"]["iterations"] == [0, 1]
        assert res["env"] == (str(r), "2")
        _assert_bit_exact(res)
        _assert_clean(res)


def test_a_rank_interrupted_before_its_snapshot_resumes_with_the_others_from_the_older_step(
    tmp_path: Path, event_log: Path
) -> None:
    """Rank 0 is interrupted after step 2's collectives and before its snapshot of step
    3, which rank 1 has taken: the ranks agree on step 2 (the loop's by-hand state, as
    the example's), restart once and end bit-exact. Before they agreed, rank 1 ran
    steps ahead of rank 0 against it and the job restarted thousands of times a minute."""
    full = [(2, STEPS, {0: 0, 1: 1})]
    _, codes = _run(tmp_path, 2, {"kind": "exception", "rank": 1, "late_snapshot": True}, full)
    assert codes == [0, 0]
    evs = _events(event_log)
    faults = [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "exception"]
    assert [(e["fault_rank"], e["iteration"]) for e in faults] == [(1, 0)]
    assert sorted((e["rank"], e["iteration"]) for e in _kinds(evs, "inprocess_restart")) == [
        (0, 1),
        (1, 1),
    ]
    for res in (_result(tmp_path, r) for r in range(2)):
        assert res["seen"]["iterations"] == [0, 1]
        assert res["seen"]["starts"] == [0, FAULT_STEP - 1]
        _assert_bit_exact(res)
        _assert_clean(res)


def test_the_memory_tier_restores_the_last_completed_step_after_an_in_process_restart(
    tmp_path: Path, event_log: Path
) -> None:
    """The state kept by ``CheckpointManager(memory_every=1)`` instead of by hand: after
    the restart every rank restores, from its own snapshot in the memory directory the
    Wrapper keeps for its run, the last step it completed; bit-exact; and the directory
    is gone when the Wrapper returns."""
    full = [(2, STEPS, {0: 0, 1: 1})]
    before = suite_shm("steadfast-mem-*")
    plan = {"kind": "exception", "rank": 1, "memory_tier": True}
    _, codes = _run(tmp_path, 2, plan, full)
    assert codes == [0, 0]
    evs = _events(event_log)
    faults = [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "exception"]
    assert [(e["fault_rank"], e["iteration"]) for e in faults] == [(1, 0)]
    loaded = _kinds(evs, "checkpoint_loaded")
    assert sorted((e["rank"], e["tier"]) for e in loaded) == [(0, "memory"), (1, "memory")]
    # every rank restores the newest step every rank holds: a snapshot whose call returned
    # before the interruption is held (its write may still be on its thread), one whose
    # call the interruption cut short may be (the interruption landed on rank 0 between
    # step 2's all-reduce and its snapshot's start, once, on a busy machine)
    seen = [_result(tmp_path, rank)["seen"] for rank in (0, 1)]
    held = min(s["snapshot_returned"] for s in seen), min(s["snapshot_called"] for s in seen)
    assert len({e["step"] for e in loaded}) == 1
    assert FAULT_STEP - 1 <= held[0] <= loaded[0]["step"] <= held[1], (loaded, seen)
    for rank in (0, 1):
        res = _result(tmp_path, rank)
        assert res["seen"]["iterations"] == [0, 1]
        _assert_bit_exact(res)
        _assert_clean(res)
    assert suite_shm("steadfast-mem-*") == before


@pytest.mark.slow
def test_sigkilled_rank_survivors_restart_with_shifted_ranks(
    tmp_path: Path, event_log: Path
) -> None:
    # rank 1 dies at step 3: ranks 0 and 2 go on as ranks 0 and 1 of a world of 2, from
    # step 3; or from step 2, where the interruption landed on a survivor between its step
    # 2's all-reduce and its snapshot (_agree_on_the_step): step 2 is then the new world's
    schedule = {
        at: [(3, at, {0: 0, 1: 1, 2: 2}), (2, STEPS, {0: 0, 2: 1})]
        for at in (FAULT_STEP, FAULT_STEP - 1)
    }
    _, codes = _run(tmp_path, 3, {"kind": "rank_killed", "rank": 1}, schedule)
    assert codes[1] == -signal.SIGKILL and codes[0] == codes[2] == 0
    evs = _events(event_log)
    died = [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "rank_died"]
    assert [e["fault_rank"] for e in died] == [1]
    assert [e["terminated_rank"] for e in _kinds(evs, "inprocess_terminated")] == [1]
    restarts = _kinds(evs, "inprocess_restart")
    assert sorted(e["rank"] for e in restarts) == [0, 2]
    assert all(e["world_size"] == 2 and e["terminated"] == [1] for e in restarts)
    moved = _kinds(evs, "inprocess_rank_reassigned")
    assert [(e["rank"], e["from_rank"], e["to_rank"]) for e in moved] == [(2, 2, 1)]
    for r in (0, 2):
        res = _result(tmp_path, r)
        assert res["seen"]["ranks"] == [(r, 3), ({0: 0, 2: 1}[r], 2)]
        assert res["seen"]["starts"][-1] in (FAULT_STEP - 1, FAULT_STEP)
        _assert_bit_exact(res)
        _assert_clean(res)
    # the dead rank's monitor process reported and went away too


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "timing"),
    [
        # Rank 0 pings 1 s after rank 1 stopped in Python: rank 1's timeout comes first,
        # while its interpreter runs.
        (1, {"late": {0: 1.0}}),
        # Rank 1 pings 1 s late, then stops in Python; rank 0 runs Python for 0.3 s after
        # its own ping, then blocks in the all-reduce that waits for rank 1: rank 0's
        # timeout comes first, its main thread outside Python for 1.2 of the 1.5 s.
        (0, {"late": {1: 1.0}, "linger": {0: 0.3}}),
    ],
    ids=["the_hung_rank_first", "its_blocked_peer_first"],
)
def test_rank_hung_in_python_is_interrupted_by_the_soft_timeout(
    tmp_path: Path, event_log: Path, first: int, timing: dict[str, Any]
) -> None:
    full = [(2, STEPS, {0: 0, 1: 1})]
    plan = {"kind": "rank_hung", "rank": 1, "soft": 1.5, "hard": 30, **timing}
    _, codes = _run(tmp_path, 2, plan, full)
    assert codes == [0, 0]
    evs = _events(event_log)
    soft = [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "soft_timeout"]
    assert [e["fault_rank"] for e in soft] == [first], soft
    where = "ping() stopped" if first == 1 else "the main thread is stuck outside Python"
    assert where in soft[0]["detail"], soft[0]
    assert not _kinds(evs, "inprocess_terminated")
    assert sorted(e["rank"] for e in _kinds(evs, "inprocess_restart")) == [0, 1]
    for r in range(2):
        res = _result(tmp_path, r)
        assert res["seen"]["iterations"] == [0, 1]
        _assert_bit_exact(res)
        _assert_clean(res)


@pytest.mark.slow
def test_rank_stuck_outside_python_is_terminated_by_the_hard_timeout(
    tmp_path: Path, event_log: Path
) -> None:
    schedule = [(3, FAULT_STEP, {0: 0, 1: 1, 2: 2}), (2, STEPS, {0: 0, 1: 1})]
    plan = {"kind": "rank_hung", "freeze": True, "rank": 2, "soft": 1.0, "hard": 2.5}
    _, codes = _run(tmp_path, 3, plan, schedule)
    assert codes[2] == -signal.SIGKILL and codes[0] == codes[1] == 0
    evs = _events(event_log)
    term = _kinds(evs, "inprocess_terminated")
    # a stopped process ignores SIGTERM: the monitor escalated to SIGKILL after the grace
    assert [(e["terminated_rank"], e["cause"], e["signal"]) for e in term] == [
        (2, "hard_timeout", "SIGKILL")
    ], [(e["kind"], e["cause"], e["rank"], e.get("detail")) for e in evs]
    causes = {(e["cause"], e["fault_rank"]) for e in _kinds(evs, "inprocess_interrupted")}
    assert ("hard_timeout", 2) in causes
    restarts = _kinds(evs, "inprocess_restart")
    assert sorted(e["rank"] for e in restarts) == [0, 1]
    assert all(e["world_size"] == 2 and e["terminated"] == [2] for e in restarts)
    for r in range(2):
        res = _result(tmp_path, r)
        _assert_bit_exact(res)
        _assert_clean(res)


@pytest.mark.slow
def test_retry_limit_ends_with_a_clear_error_on_every_rank(tmp_path: Path, event_log: Path) -> None:
    plan = {"kind": "exception", "rank": 1, "step": 1, "max_fault_iteration": 99}
    _, codes = _run(tmp_path, 2, {**plan, "max_iterations": 3}, None)
    assert codes == [0, 0]
    evs = _events(event_log)
    faults = [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "exception"]
    assert [e["iteration"] for e in faults] == [0, 1, 2]
    for r in range(2):
        res = _result(tmp_path, r)
        assert res["params"] is None
        # max_iterations=3: the function ran 3 times, as NVRx's RetryController allows
        assert "retry limit reached: iteration=3 max_iterations=3" in res["error"]
        assert res["seen"]["iterations"] == [0, 1, 2]
        _assert_clean(res)


@pytest.mark.slow
def test_atomic_section_holds_off_the_interruption(tmp_path: Path, event_log: Path) -> None:
    full = [(2, STEPS, {0: 0, 1: 1})]
    plan = {"kind": "exception", "rank": 1, "atomic": True}
    _, codes = _run(tmp_path, 2, plan, full)
    assert codes == [0, 0]
    entered = float((tmp_path / "atomic_entered").read_text())
    left = float((tmp_path / "atomic_left").read_text())
    interrupted = float((tmp_path / "interrupted_at").read_text())
    fault = next(e["time"] for e in _kinds(_events(event_log), "inprocess_interrupted"))
    assert entered <= fault < left, "rank 1 must fault while rank 0 is inside atomic()"
    assert interrupted >= left, "the interruption landed inside atomic()"
    for r in range(2):
        res = _result(tmp_path, r)
        _assert_bit_exact(res)
        _assert_clean(res)


@pytest.mark.slow
def test_lost_rank_and_monitor_are_found_by_the_heartbeat_timeout(
    tmp_path: Path, event_log: Path
) -> None:
    schedule = [(3, FAULT_STEP, {0: 0, 1: 1, 2: 2}), (2, STEPS, {0: 0, 2: 1})]
    plan = {"kind": "rank_killed", "lost": True, "rank": 1, "heartbeat": 1.5}
    _, codes = _run(tmp_path, 3, plan, schedule)
    assert codes[1] == -signal.SIGKILL and codes[0] == codes[2] == 0
    evs = _events(event_log)
    # nobody was left to report the death: the store host noticed the silence
    lost = [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "heartbeat_lost"]
    assert [(e["fault_rank"], e["rank"]) for e in lost] == [(1, 0)]
    assert not [e for e in _kinds(evs, "inprocess_interrupted") if e["cause"] == "rank_died"]
    restarts = _kinds(evs, "inprocess_restart")
    assert sorted(e["rank"] for e in restarts) == [0, 2]
    assert all(e["terminated"] == [1] for e in restarts)
    for r in (0, 2):
        res = _result(tmp_path, r)
        _assert_bit_exact(res)
        _assert_clean(res)
