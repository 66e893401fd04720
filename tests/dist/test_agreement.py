"""Real 2-rank gloo groups: ranks agree on NaNs, shutdowns and signals at the same step."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from sfharness import Ranks, read_events, run_ranks, wait_for, write_atomic


# ----------------------------------------------------------------- NaN agreement
def _nan_on_one_rank(rank: int, world: int, workdir: Path) -> list[tuple[int, bool, bool]]:
    from steadfast import NaNDetector

    d = NaNDetector(action="skip", max_consecutive=2)
    out = []
    for step in range(6):
        loss = torch.tensor(float("nan") if (rank == 1 and step in (2, 3)) else 1.0 + step)
        out.append((step, d.check_loss(loss, step), d.should_rollback))
    return out


def test_nan_on_one_rank_is_seen_by_both(tmp_path: Path):
    env = {"STEADFAST_EVENTS": str(tmp_path / "events.jsonl")}
    r0, r1 = run_ranks(_nan_on_one_rank, tmp_path, env=env)
    assert r0 == r1  # same verdict, same step, on both ranks
    assert [ok for _, ok, _ in r0] == [True, True, False, False, True, True]
    assert [rb for _, _, rb in r0] == [False, False, False, True, False, False]
    ev = read_events(tmp_path / "events.jsonl")
    nan = [e for e in ev if e["kind"] == "nan_detected"]
    assert [(e["rank"], e["step"], e["ranks_affected"]) for e in nan] == [(1, 2, 1), (1, 3, 1)]
    roll = [e for e in ev if e["kind"] == "nan_rollback_recommended"]
    assert [(e["rank"], e["step"]) for e in roll] == [(0, 3)]


def _ddp_train(rank: int, world: int, workdir: Path, nan_rank: int) -> list[torch.Tensor]:
    """DDP training where one rank's gradients go NaN at step 3 only on that rank (after
    the all-reduce, as a faulty GPU would); skip keeps the replicas identical."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from steadfast import NaNDetector

    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    d = NaNDetector(action="skip")
    skipped = []
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 3 and rank == nan_rank:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if d.check_gradients(model, step):
            opt.step()
        else:
            skipped.append(step)
    assert skipped == [3]
    return [p.detach().clone() for p in model.parameters()]


def test_gradient_nan_on_one_rank_keeps_replicas_identical(tmp_path: Path):
    p0, p1 = run_ranks(_ddp_train, tmp_path, args=(1,))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in p0)


# ----------------------------------------------------------------- agreed shutdown
def _train_until_shutdown(rank: int, world: int, workdir: Path, agree: bool) -> dict:
    from steadfast import ShutdownHandler

    h = ShutdownHandler(timeout_sec=60, agree=agree)
    h.register()
    stopped_at = None
    for step in range(10_000):
        time.sleep(0.01)
        write_atomic(workdir / f"step_{rank}", str(step))  # polled by the test
        if h.should_shutdown(step):
            stopped_at = step
            break
    h.finish()
    sig = h.signal_received
    return {"stopped_at": stopped_at, "signal": sig.name if sig else None}


def test_sigterm_to_one_rank_stops_both_after_the_same_step(tmp_path: Path):
    env = {"STEADFAST_EVENTS": str(tmp_path / "events.jsonl")}
    ranks = Ranks(_train_until_shutdown, tmp_path, args=(True,), env=env)
    try:
        pid1 = ranks.pid(1)

        def progressed() -> bool:
            files = [tmp_path / f"step_{r}" for r in (0, 1)]
            return all(f.exists() and int(f.read_text()) >= 5 for f in files)

        wait_for(progressed, 60, "both ranks at step 5")
        os.kill(pid1, signal.SIGTERM)
        assert ranks.wait(60) == [0, 0]
    finally:
        ranks.kill()
    r0, r1 = ranks.results()
    assert r0["stopped_at"] == r1["stopped_at"] is not None
    assert (r0["signal"], r1["signal"]) == (None, "SIGTERM")
    ev = read_events(tmp_path / "events.jsonl")
    req = [e for e in ev if e["kind"] == "shutdown_requested"]
    agreed = [e for e in ev if e["kind"] == "shutdown_agreed"]
    assert [(e["rank"], e["cause"]) for e in req] == [(1, "SIGTERM")]
    assert [(e["rank"], e["step"], e["ranks_signalled"]) for e in agreed] == [
        (0, r0["stopped_at"], 1)
    ]


def _late_peer(rank: int, world: int, workdir: Path, no_gloo: bool) -> dict:
    """From step 1, rank 1 reaches each ``should_shutdown`` only once rank 0 has come back
    from it, and signals itself at step 2: a blocking agreement would wait for it forever.
    (The first call, at step 0, makes the count's group where it needs one of its own:
    that once, every rank waits for the others.)"""
    import torch.distributed as dist

    from steadfast import ShutdownHandler

    get_backend = dist.get_backend
    if no_gloo:  # the group the handler is given says it has no gloo (an NCCL world)
        dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    h = ShutdownHandler(timeout_sec=60, agree=True)
    h.register()
    said = []
    for step in range(5):
        if rank == 1 and step >= 1:
            wait_for((workdir / f"back_{step}").exists, 20, f"rank 0 back from step {step}")
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        said.append(h.should_shutdown(step))
        if rank == 0:
            write_atomic(workdir / f"back_{step}", "")
        if said[-1]:
            break
    counted_on = get_backend(h._cpu_group)
    h.finish()
    dist.get_backend = get_backend  # type: ignore[assignment]
    return {"said": said, "counted_on": counted_on, "own_group": h._cpu_group is not None}


@pytest.mark.parametrize("no_gloo", [False, True], ids=["gloo_world", "nccl_world"])
def test_the_agreement_makes_no_step_wait_and_stops_both_one_step_later(
    tmp_path: Path, no_gloo: bool
):
    env = {"STEADFAST_EVENTS": str(tmp_path / "events.jsonl")}
    r0, r1 = run_ranks(_late_peer, tmp_path, args=(no_gloo,), env=env)
    # signalled at step 2 on rank 1; its count, started there, is read at step 3
    assert r0["said"] == r1["said"] == [False, False, False, True]
    assert r0["counted_on"] == r1["counted_on"] == "gloo"
    ev = read_events(tmp_path / "events.jsonl")
    agreed = [
        (e["rank"], e["step"], e["ranks_signalled"]) for e in ev if e["kind"] == "shutdown_agreed"
    ]
    assert agreed == [(0, 3, 1)]


def _nan_check_carries_the_shutdown(rank: int, world: int, workdir: Path) -> dict:
    """The loop a user writes: a NaN check, then the agreed shutdown, every step. Rank 1
    also holds a stale rider (a handler it abandoned), which must change nothing."""
    import torch.distributed as dist

    from steadfast import NaNDetector, ShutdownHandler
    from steadfast.riders import Rider

    sizes: list[int] = []
    real = dist.all_reduce

    def counted(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(t.numel())
        return real(t, *args, **kwargs)  # type: ignore[arg-type]

    dist.all_reduce = counted  # type: ignore[assignment]
    stale = Rider(lambda: False) if rank == 1 else None
    h = ShutdownHandler(timeout_sec=60, agree=True)
    h.register()
    d = NaNDetector(action="skip")
    said = []
    for step in range(6):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # before this step's NaN check
        loss = torch.tensor(float("nan") if (rank == 0 and step == 1) else 1.0 + step)
        said.append((d.check_loss(loss, step), h.should_shutdown(step)))
        if said[-1][1]:
            break
    h.finish()
    if stale is not None:
        stale.close()
    dist.all_reduce = real  # type: ignore[assignment]
    return {"said": said, "sizes": sizes}


def test_the_nan_checks_all_reduce_carries_the_agreed_shutdown(tmp_path: Path):
    env = {"STEADFAST_EVENTS": str(tmp_path / "events.jsonl")}
    r0, r1 = run_ranks(_nan_check_carries_the_shutdown, tmp_path, env=env)
    # rank 1's signal came before step 2's NaN check: both stop after step 2 itself
    assert r0["said"] == r1["said"] == [(True, False), (False, False), (True, True)]
    # the count of its own only at the first call (the rider boards there); after it,
    # the NaN check's all-reduce (flag, shutdown slot) is the step's one collective
    assert r0["sizes"] == r1["sizes"] == [2, 1, 2, 2]
    ev = read_events(tmp_path / "events.jsonl")
    agreed = [
        (e["rank"], e["step"], e["ranks_signalled"]) for e in ev if e["kind"] == "shutdown_agreed"
    ]
    assert agreed == [(0, 2, 1)]
    nan = [(e["rank"], e["step"]) for e in ev if e["kind"] == "nan_detected"]
    assert nan == [(0, 1)]


# ----------------------------------------------------------------- a gather read later
def _gather_later(rank: int, world: int, workdir: Path) -> dict:
    import torch.distributed as dist

    from steadfast.dist import PendingGather

    small = PendingGather({"rank": rank, "name": f"node{rank}"})
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)  # the loop's own collectives go on while it gathers
    big = PendingGather("x" * (100 if rank == 0 else 10_000), slot=1024)  # rank 1's too big
    dist.all_reduce(x)
    return {
        "small": small.read(),
        "big": [len(v) for v in big.read()],
        "largest": big.largest,
        "x": x.item(),
    }


def test_a_gather_started_at_one_step_is_read_at_the_next(tmp_path: Path):
    r0, r1 = run_ranks(_gather_later, tmp_path)
    assert r0 == r1
    assert r0["small"] == [{"rank": 0, "name": "node0"}, {"rank": 1, "name": "node1"}]
    assert r0["big"] == [100, 10_000]  # one rank past its slot: every rank gathered again
    assert r0["largest"] > 10_000  # its pickle: the next slot can be sized on every rank
    assert r0["x"] == 6.0


def _left_pending(rank: int, world: int, workdir: Path) -> list[str]:
    """A loop's last count and gather, started and never read (the script ended), then
    the group destroyed as a script ends: no gloo thread may outlive it."""
    import torch.distributed as dist

    from steadfast.dist import PendingCount, PendingGather

    count, gather = PendingCount(rank == 1), PendingGather({"rank": rank})
    dist.barrier()  # both ended on every rank (gloo runs them in order)
    dist.destroy_process_group()
    time.sleep(0.2)  # the group's threads end as its last reference goes
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()]
    del count, gather
    return [n for n in names if "gloo" in n]


def test_a_count_and_a_gather_left_pending_do_not_keep_the_group_alive(tmp_path: Path):
    assert run_ranks(_left_pending, tmp_path) == [[], []]


def test_a_gather_in_one_process_is_its_own_object() -> None:
    from steadfast.dist import PendingGather

    obj = {"medians": {"train_step": 0.1}}
    assert PendingGather(obj).read() == [obj]


# ----------------------------------------------------------------- collective health
def _health(rank: int, world: int, workdir: Path, join: bool) -> dict:
    from steadfast import check_nccl_health

    if join or rank == 0:
        start = time.monotonic()
        ok = check_nccl_health(timeout_sec=1.0)
        elapsed = time.monotonic() - start
        (workdir / "rank0_done").write_text("1")
        return {"ok": ok, "elapsed": elapsed}
    # rank 1 stays alive but never joins the collective, until rank 0 has given up
    wait_for(lambda: (workdir / "rank0_done").exists(), 60)
    return {"ok": None, "elapsed": 0.0}


def test_collective_health_true_when_both_join(tmp_path: Path):
    r0, r1 = run_ranks(_health, tmp_path, args=(True,))
    assert r0["ok"] is True and r1["ok"] is True


def test_collective_health_false_within_timeout_when_peer_never_joins(tmp_path: Path):
    env = {"STEADFAST_EVENTS": str(tmp_path / "events.jsonl")}
    ranks = Ranks(_health, tmp_path, args=(False,), env=env)
    try:
        codes = ranks.wait(60)
    finally:
        ranks.kill()
    r0, _ = ranks.results()
    assert r0["ok"] is False
    assert 1.0 <= r0["elapsed"] < 10.0  # returned at its timeout, not the group's 60 s
    assert codes == [0, 0]
    ev = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "health_check"]
    assert [(e["rank"], e["ok"], e["cause"]) for e in ev] == [(0, False, "timeout")]


# ----------------------------------------------------------------- gathered signals
def _gather_signal(rank: int, world: int, workdir: Path) -> list[bool]:
    from steadfast import DistributedSignalHandler
    from steadfast.dist import agree_any

    with DistributedSignalHandler(signal.SIGUSR1) as h:
        if rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)
        agree_any(False)  # a barrier: rank 0's signal has landed before we gather
        return h.signals_received()


@pytest.mark.parametrize("world", [2, 3])
def test_signals_received_is_one_flag_per_rank(tmp_path: Path, world: int):
    results = run_ranks(_gather_signal, tmp_path, world_size=world)
    expected = [True] + [False] * (world - 1)
    assert results == [expected] * world


# ----------------------------------------------------------------- forced exit while stuck
def _stuck_in_collective(rank: int, world: int, workdir: Path) -> None:
    import torch.distributed as dist

    from steadfast import ShutdownHandler

    if rank == 1:  # alive, but never joins the collective
        wait_for(lambda: (workdir / "release").exists(), 120)
        return
    h = ShutdownHandler(timeout_sec=1.0)
    h.register()
    (workdir / "entering").write_text("1")
    dist.all_reduce(torch.ones(1))  # blocks in C++: Python signal handlers cannot run
    raise AssertionError("the collective should never complete")


def test_forced_exit_fires_while_blocked_in_a_collective(tmp_path: Path):
    env = {"STEADFAST_EVENTS": str(tmp_path / "events.jsonl")}
    ranks = Ranks(_stuck_in_collective, tmp_path, env=env)
    try:
        pid0 = ranks.pid(0)
        wait_for(lambda: (tmp_path / "entering").exists(), 60, "rank 0 in the collective")
        time.sleep(0.3)
        start = time.monotonic()
        os.kill(pid0, signal.SIGTERM)
        code = ranks.procs[0].wait(timeout=30)  # the group's own timeout is 60 s
        elapsed = time.monotonic() - start
    finally:
        (tmp_path / "release").write_text("1")
        ranks.kill()
    assert code == 1
    assert elapsed < 30
    ev = read_events(tmp_path / "events.jsonl")
    assert [(e["kind"], e["rank"]) for e in ev] == [
        ("shutdown_requested", 0),
        ("shutdown_forced", 0),
    ]
