"""NVRx ``inprocess`` (seed 004) called as its users call it, on steadfast: the frozen
state hooks receive, rank assignment with a RankAssignmentCtx, Compose's calling
convention, a store of NVRx's shape, the ValueError and the logging warning."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from sfharness import Ranks
from steadfast.inprocess import (
    ActiveWorldSizeDivisibleBy,
    CallWrapper,
    Compose,
    FillGaps,
    FrozenState,
    MaxActiveWorldSize,
    Mode,
    RankAssignmentCtx,
    RankDiscarded,
    ShiftRanks,
    State,
    StoreMixin,
    Wrapper,
)


def test_hooks_get_a_frozen_state_built_as_nvrx_builds_it() -> None:
    state = State(3, 8)  # NVRx's State(rank, world_size)
    assert (state.initial_rank, state.initial_world_size, state.mode) == (3, 8, Mode.INITIALIZED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.rank = 0  # type: ignore[misc]
    assert FrozenState is State


def _assign(assignment: Any, world: int, terminated: set[int]) -> dict[int, int | None]:
    """Every rank's new rank through NVRx's per-rank convention (None: discarded)."""
    out: dict[int, int | None] = {}
    for rank in range(world):
        try:
            ctx = assignment(RankAssignmentCtx(State(rank, world), None, set(terminated)))
        except RankDiscarded:
            out[rank] = None
            continue
        assert ctx.terminated_ranks == set()
        assert ctx.state.world_size == world - len(terminated)
        out[rank] = ctx.state.rank
    return out


def test_rank_assignment_with_a_ctx() -> None:
    assert _assign(ShiftRanks(), 8, {1, 4, 5}) == {
        0: 0, 1: None, 2: 1, 3: 2, 4: None, 5: None, 6: 3, 7: 4}  # fmt: skip
    # FillGaps as NVRx documents it: the ranks past the new world fill the holes in order
    assert _assign(FillGaps(), 8, {1, 4, 5}) == {
        0: 0, 1: None, 2: 2, 3: 3, 4: None, 5: None, 6: 1, 7: 4}  # fmt: skip
    assert _assign(ShiftRanks(), 4, set()) == {0: 0, 1: 1, 2: 2, 3: 3}
    ctx = RankAssignmentCtx(State(6, 7), None, set())
    ctx = Compose(ActiveWorldSizeDivisibleBy(2), MaxActiveWorldSize(6))(ctx)
    assert (ctx.state.active_world_size, ctx.state.active_rank, ctx.state.mode) == (
        6, None, Mode.INACTIVE)  # fmt: skip
    ctx = ActiveWorldSizeDivisibleBy(4)(RankAssignmentCtx(State(2, 7), None, set()))
    assert (ctx.state.active_world_size, ctx.state.active_rank, ctx.state.mode) == (
        4, 2, Mode.ACTIVE)  # fmt: skip


def test_compose_calls_as_nvrx_does() -> None:
    class Base:
        pass

    class Foo(Base):
        def __call__(self) -> None:
            return None

    class Bar(Foo):
        def __call__(self) -> None:
            return None

    composed = Compose(Foo(), Bar())
    assert isinstance(composed, Foo) and not isinstance(composed, Bar)
    composed()  # hooks of no arguments
    assert Compose(lambda a, b: (a + 1, b + 1), lambda a, b: (a, b))(0, 1) == (1, 2)


# ---------------------------------------------------------------------- real calls
def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class HostedStore(dist.TCPStore, StoreMixin):  # type: ignore[misc]
    """An NVRx-shaped store: a torch TCPStore itself, built from the user's store_kwargs
    only; rank 0 hosts it if the port is free (else, like the others, connects), as
    NVRx's own TCPStore does."""

    def __init__(self, port: int) -> None:
        if os.environ["RANK"] == "0":
            try:
                super().__init__("127.0.0.1", port, is_master=True, wait_for_workers=False)
                return
            except RuntimeError:  # hosted already (by this rank's monitor process)
                pass
        super().__init__("127.0.0.1", port, is_master=False, wait_for_workers=False)


def _nested(workdir: Path, fails: bool) -> Wrapper:
    """A Wrapper with the nested restarter's hooks; rank 0 logs their lines to a file."""
    from steadfast.inprocess import AbortTorchDistributed, RetryController
    from steadfast.inprocess import nested_restarter as nr

    log = logging.getLogger("steadfast.inprocess.restarter")
    log.addHandler(logging.FileHandler(workdir / f"restarter_{os.environ['RANK']}.log"))
    log.setLevel(logging.INFO)
    return Wrapper(
        initialize=Compose(
            nr.NestedRestarterHandlingCompleted(), RetryController(2 if fails else 3)
        ),
        abort=Compose(AbortTorchDistributed(), nr.NestedRestarterHandlingStarting()),
        completion=nr.NestedRestarterFinalized(),
        terminate=nr.NestedRestarterAborted(),
        monitor_process_interval=_td(0.1),
        heartbeat_interval=_td(0.1),
        last_call_wait=_td(0.2),
    )


def nvrx_calls(rank: int, world: int, workdir: Path, case: str) -> Any:
    common: dict[str, Any] = dict(monitor_process_interval=_td(0.1), last_call_wait=_td(0.2))
    if case in ("nested", "nested_fails"):

        @_nested(workdir, case == "nested_fails")
        def flaky(call_wrapper: CallWrapper | None = None) -> int:
            assert call_wrapper is not None
            if rank == 1 and (call_wrapper.iteration == 0 or case == "nested_fails"):
                raise ValueError("injected")
            return call_wrapper.iteration

        try:
            return flaky()
        except Exception as exc:
            return type(exc).__name__
    if case == "store":
        wrapper = Wrapper(
            store_factory=HostedStore,
            store_kwargs={"port": int(os.environ["SF_STORE_PORT"])},
            **common,
        )
    else:
        wrapper = Wrapper(monitor_process_logfile=str(workdir / "monitor_{rank}.log"), **common)

    busy_to_the_end: list[bool] = []

    @wrapper
    def train(call_wrapper: CallWrapper | None = None) -> Any:
        assert call_wrapper is not None
        if case != "store":
            return call_wrapper.iteration
        if call_wrapper.iteration == 0:
            # rank 1 fails while rank 0 is busy: only the store's interruption, seen by
            # rank 0's monitor thread on its own connection, frees rank 0 early
            if rank == 1:
                raise ValueError("injected")
            for _ in range(3000):
                time.sleep(0.01)
            busy_to_the_end.append(True)
        return call_wrapper.iteration, busy_to_the_end

    if case == "initialized":
        dist.init_process_group("gloo", init_method=f"file://{workdir}/pg", rank=rank,
                                world_size=world)  # fmt: skip
        # gloo's init returns on a rank whose side of the mesh is up; the peer may still
        # be connecting, and a group destroyed now cut it off ("connectFullMesh failed:
        # Connection closed by peer", seen once in CI): both sides up before going on
        dist.barrier()
        try:
            train()
        except ValueError as exc:
            return str(exc)
        finally:
            dist.destroy_process_group()
    if case == "logging":
        root = logging.getLogger()
        handlers, root.handlers = root.handlers[:], []
        try:
            with pytest.warns(UserWarning, match="logging not initialized"):
                train()
        finally:
            root.handlers = handlers
        return (workdir / f"monitor_{rank}.log").read_text()
    return train()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, case: str, env: dict[str, str] | None = None) -> list[Any]:
    port = _free_port()
    base = {"SFHARNESS_NO_INIT": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1)}
    ranks = Ranks(nvrx_calls, tmp_path, 2, (case,), {**base, **(env or {})})
    ranks.wait(120)
    return ranks.results()


def test_an_initialised_group_is_a_value_error(tmp_path: Path) -> None:
    for message in _run(tmp_path, "initialized"):
        assert "not torch.distributed.is_initialized()" in message


def test_unconfigured_logging_warns_and_the_monitor_logs(tmp_path: Path) -> None:
    for log in _run(tmp_path, "logging"):
        assert "monitor_process" in log and "target_pid" in log


def test_a_store_of_nvrxs_shape(tmp_path: Path) -> None:
    """The restart protocol runs over the user's store: rank 1's fault interrupts rank 0
    through it, both restart, and the host (rank 0's monitor) stays until both left."""
    assert _run(tmp_path, "store", {"SF_STORE_PORT": str(_free_port())}) == [(1, [])] * 2


def _lines(tmp_path: Path) -> list[str]:
    text = (tmp_path / "restarter_0.log").read_text()
    return [line.split("] ", 1)[1] for line in text.splitlines()]  # after "[rank 0] "


def test_nested_restarter_hooks_log_each_state(tmp_path: Path) -> None:
    assert _run(tmp_path, "nested") == [1, 1]  # rank 1 failed once; both restarted
    lines = _lines(tmp_path)
    assert lines[0] == "[NestedRestarter] name=[InProcess] state=initialize"
    assert "[NestedRestarter] name=[InProcess] state=handling stage=starting" in lines
    assert lines[-2:] == [
        "[NestedRestarter] name=[InProcess] state=handling stage=completed",
        "[NestedRestarter] name=[InProcess] state=finalized",
    ]


def test_terminate_runs_when_the_call_ends_with_an_error(tmp_path: Path) -> None:
    assert _run(tmp_path, "nested_fails") == ["RestartAbort", "RestartAbort"]
    assert _lines(tmp_path)[-1] == "[NestedRestarter] name=[InProcess] state=aborted"
