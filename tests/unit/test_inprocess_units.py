"""In-process restart pieces that need no process group: the Wrapper's validation, rank
assignment and filters, the retry limit, the fault counter, CallWrapper injection."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Optional

import pytest

from steadfast.config import ConfigError
from steadfast.inprocess import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    CallWrapper,
    FaultCounter,
    FillGaps,
    HealthCheckError,
    InterruptedIteration,
    MaxActiveWorldSize,
    RestartAbort,
    RestartError,
    RetryController,
    ShiftRanks,
    State,
    Wrapper,
)
from steadfast.inprocess.wrapper import _call_wrapper_params


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


# -- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"soft_timeout": s(100)}, "soft_timeout < hard_timeout < barrier_timeout"),
        ({"hard_timeout": s(200)}, "soft_timeout < hard_timeout < barrier_timeout"),
        ({"monitor_thread_interval": s(60)}, "monitor_thread_interval"),
        ({"monitor_process_interval": s(61)}, "monitor_process_interval"),
        ({"progress_watchdog_interval": s(90)}, "progress_watchdog_interval"),
        ({"heartbeat_timeout": s(0.5)}, "heartbeat_timeout"),
        ({"soft_timeout": 60}, "soft_timeout must be a datetime.timedelta"),
        ({"last_call_wait": s(0)}, "last_call_wait must be positive"),
        ({"monitor_process_logfile": "rel/{rank}.log"}, "monitor_process_logfile"),
        ({"abort": 3}, "abort must be a Abort"),
        ({"store_kwargs": "x"}, "store_kwargs must be a dict"),
    ],
)
def test_wrapper_rejects_bad_parameters_with_one_clear_error(kwargs, field) -> None:
    with pytest.raises(ConfigError, match="Wrapper: ") as err:
        Wrapper(**kwargs)
    assert field in str(err.value)


def test_wrapper_defaults_are_the_seeds() -> None:
    w = Wrapper()
    assert (w.soft_timeout, w.hard_timeout, w.barrier_timeout) == (s(60), s(90), s(120))
    assert (w.heartbeat_timeout, w.completion_timeout, w.last_call_wait) == (s(30), s(120), s(1))
    assert w.termination_grace_time == s(5) and w.monitor_thread_interval == s(1)
    assert isinstance(w.rank_assignment, ShiftRanks) and w.enabled


def test_disabled_wrapper_returns_the_function_itself() -> None:
    def fn() -> int:
        return 1

    assert Wrapper(enabled=False)(fn) is fn


def test_call_needs_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="RANK, WORLD_SIZE not set"):
        Wrapper()(lambda: None)()


def test_call_outside_the_main_thread_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            Wrapper()(lambda: None)()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert isinstance(errors[0], RestartError) and "main thread" in str(errors[0])


def test_call_with_torch_distributed_initialised_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    try:
        with pytest.raises(RestartError, match="already initialised"):
            Wrapper()(lambda: None)()
    finally:
        dist.destroy_process_group()


def test_call_wrapper_parameters_are_found_by_annotation() -> None:
    def f(a: int, cw: Optional[CallWrapper] = None, other: str = "") -> None: ...  # noqa: UP045

    def f2(cw: CallWrapper | None = None) -> None: ...

    def g(call_wrapper: CallWrapper) -> None: ...

    def h(x: int) -> None: ...

    assert _call_wrapper_params(f) == ["cw"]
    assert _call_wrapper_params(f2) == ["cw"]
    assert _call_wrapper_params(g) == ["call_wrapper"]
    assert _call_wrapper_params(h) == []


def test_interruption_is_not_an_exception_a_training_loop_would_swallow() -> None:
    assert not issubclass(InterruptedIteration, Exception)


# -- rank assignment ----------------------------------------------------------------------
def _after(world: int, terminated: set[int], assignment: tuple[int, ...] | None = None) -> list:
    """Every initial rank's state for the next iteration."""
    out = []
    for r in range(world):
        st = State.first(r, world).replace(
            iteration=1,
            terminated=frozenset(terminated),
            assignment=assignment or tuple(range(world)),
        )
        out.append(st)
    return out


def test_shift_ranks_closes_the_gaps_in_order() -> None:
    states = [ShiftRanks()(st) for st in _after(5, {1, 3})]
    assert [st.rank for st in states] == [0, -1, 1, -1, 2]
    assert {st.world_size for st in states} == {3}
    assert states[0].assignment == (0, -1, 1, -1, 2)
    assert states[1].active_rank is None


def test_fill_gaps_moves_only_the_highest_ranks() -> None:
    states = [FillGaps()(st) for st in _after(6, {1})]
    # rank 5 moves into the hole at 1; ranks 0, 2, 3, 4 keep theirs
    assert [st.rank for st in states] == [0, -1, 2, 3, 4, 1]
    states = [FillGaps()(st) for st in _after(6, {0, 2})]
    # the ranks past the new world size (4, 5) fill the holes (0, 2) in order, as NVRx
    # documents FillGaps
    assert [st.rank for st in states] == [-1, 1, -1, 3, 0, 2]


def test_shift_ranks_composes_over_previous_assignments() -> None:
    # after a first loss (rank 1), initial 2 is rank 1; losing it next shifts initial 3
    first = tuple(ShiftRanks()(_after(4, {1})[0]).assignment)
    states = [ShiftRanks()(st) for st in _after(4, {1, 2}, first)]
    assert [st.rank for st in states] == [0, -1, -1, 1]


def test_rank_filters_pick_the_active_ranks() -> None:
    base = [ShiftRanks()(st) for st in _after(7, {6})]  # world 6
    by4 = [ActiveWorldSizeDivisibleBy(4)(st) for st in base]
    assert [st.active_rank for st in by4] == [0, 1, 2, 3, None, None, None]
    assert {st.active_world_size for st in by4} == {4}
    capped = [(ShiftRanks() | MaxActiveWorldSize(2))(st) for st in _after(7, {6})]
    assert [st.active_rank is not None for st in capped] == [True, True] + [False] * 5
    assert all(ActivateAllRanks()(st).active for st in base if st.rank >= 0)
    with pytest.raises(RestartAbort, match="leaves no active rank"):
        ActiveWorldSizeDivisibleBy(8)(base[0])


def test_no_rank_left_is_a_clear_abort() -> None:
    with pytest.raises(RestartAbort, match="no rank alive"):
        ShiftRanks()(_after(2, {0, 1})[0])


# -- hooks --------------------------------------------------------------------------------
def test_retry_controller_limits_iterations_and_world_size() -> None:
    st = State.first(0, 4)
    ctl = RetryController(max_iterations=2, min_world_size=3)
    assert ctl(st.replace(iteration=1)) == st.replace(iteration=1)  # hooks return the state
    # NVRx: max_iterations=N runs N iterations (0..N-1); iteration N is refused
    with pytest.raises(RestartAbort, match="retry limit reached: iteration=2 max_iterations=2"):
        ctl(st.replace(iteration=2))
    with pytest.raises(RestartAbort, match="min_world_size=3"):
        ctl(st.replace(iteration=1, world_size=2))
    with pytest.raises(RestartAbort, match="min_active_world_size=2"):
        RetryController(min_active_world_size=2)(st.replace(active_world_size=1))


def test_fault_counter_counts_only_this_ranks_own_faults() -> None:
    fc = FaultCounter(max_rank_faults=1)
    st = State.first(3, 4)
    fc(st.replace(fn_exception=InterruptedIteration()))  # interrupted by another rank
    fc(st.replace(fn_exception=ValueError("x")))  # first own fault
    with pytest.raises(HealthCheckError, match="rank 3 faulted 2 times"):
        fc(st.replace(fn_exception=ValueError("y")))


# -- Compose (NVRx: function composition, right to left) ----------------------------------
def test_compose_is_function_composition_right_to_left() -> None:
    from steadfast.inprocess import Compose

    calls: list[str] = []

    def hook(name: str):
        def f(x: int) -> int:
            calls.append(name)
            return x * 10 + len(calls)

        return f

    assert Compose(hook("a"), hook("b"), hook("c"))(0) == 123  # a(b(c(0)))
    assert calls == ["c", "b", "a"]


def test_composed_hooks_chain_the_state_and_keep_their_kind() -> None:
    from steadfast.inprocess import Abort, AbortTorchDistributed, Compose, HealthCheck

    st = State.first(0, 2).replace(fn_exception=ValueError("mine"))
    twice = Compose(FaultCounter(3), FaultCounter(3))
    assert twice(st) == st  # was AttributeError: a hook's None fed to the next
    assert isinstance(twice, HealthCheck) and isinstance(twice, Compose)
    aborts = Compose(AbortTorchDistributed(), AbortTorchDistributed())
    assert isinstance(aborts, Abort) and aborts(st) == st
    assert isinstance(Compose(ShiftRanks(), FaultCounter()), Compose)  # no common hook kind


def test_compose_calling_convention_is_nvrxs() -> None:
    from steadfast.inprocess import Compose

    with pytest.warns(UserWarning, match="returned None"):  # the chain is broken: None on
        assert Compose(lambda x: x, lambda x: None)(1) is None
    assert Compose(lambda a, b: (a + 1, b + 1), lambda a, b: (a * 2, b * 2))(1, 2) == (3, 5)
    calls: list[int] = []
    Compose(lambda: calls.append(1), lambda: calls.append(2))()  # hooks of no arguments
    assert calls == [2, 1]


def test_pipe_runs_left_to_right() -> None:
    order: list[str] = []

    class Note(FaultCounter):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def __call__(self, state: State) -> State:
            order.append(self.name)
            return state

    (Note("a") | Note("b"))(State.first(0, 1))
    assert order == ["a", "b"]


# -- what a rank records as its own fault -------------------------------------------------
def test_an_exception_after_another_rank_ended_the_iteration_is_not_a_fault_of_its_own(
    tmp_path, monkeypatch
) -> None:
    """Rank 1 records its fault (ending iteration 0), then aborts its process group: rank
    0's collective fails on the closed connection before rank 0's monitor thread delivers
    the interruption. That exception is rank 1's consequence: no record or event of rank
    0's own. An exception in an iteration no rank ended is rank 0's fault."""
    import json

    from steadfast.inprocess.monitor_thread import MonitorThread
    from steadfast.inprocess.store import TCPStore

    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("STEADFAST_EVENTS", str(log))
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=s(10))
    rank0 = object.__new__(CallWrapper)  # only what recording a fault reads
    rank0.store_client, rank0.state = store, State.first(0, 2)
    rank0._monitor_thread = MonitorThread(lambda first: None)  # it delivered nothing yet

    store.record_interruption(0, 1, "exception", "InjectedFaultError: rank 1's own")
    rank0._record_own_fault(0, RuntimeError("Connection closed by peer [127.0.0.1]:12715"))
    assert [(c["rank"], c["cause"]) for c in store.interruptions(0)] == [(1, "exception")]

    rank0._record_own_fault(1, RuntimeError("a fault of rank 0's own"))
    assert [(c["rank"], c["cause"]) for c in store.interruptions(1)] == [(0, "exception")]
    evs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["kind"], e["iteration"], e["fault_rank"], e["first"]) for e in evs] == [
        ("inprocess_interrupted", 1, 0, True)
    ]


def test_an_aborted_ranks_hard_timeout_counts_from_the_abort_and_the_grace() -> None:
    """A rank interrupted and aborted by its monitor thread may wait in a call the abort
    does not release (a collective with a frozen peer, released when the peer is
    terminated): its hard timeout counts from the abort plus the termination grace,
    however long its monitor thread then goes unscheduled (a survivor was terminated
    4-20 ms before its frozen peer while that was the condition); a rank never aborted
    counts from its last progress."""
    from steadfast.inprocess.monitor import MonitorProcessConfig, hard_age

    cfg = MonitorProcessConfig(
        initial_rank=0, world_size=2, rank_pid=1, store_factory=object,  # type: ignore[arg-type]
        store_kwargs={}, serve_store=False, coordinate=False, interval=0.1,
        thread_interval=0.1, soft_timeout=1.0, hard_timeout=2.5, heartbeat_timeout=5.0,
        termination_grace_time=0.5, linger=0.0, logfile=None,
    )  # fmt: skip
    progress, aborted = 100.0, 101.0
    assert hard_age(cfg, 103.0, progress, 0.0) == pytest.approx(3.0)  # never aborted
    assert hard_age(cfg, 103.0, progress, aborted) == pytest.approx(1.5)
    # the frozen peer (progress 100.0) is terminated by 100 + 2.5 + 0.5 = 103.0; the
    # survivor's hard timeout ends at 101 + 0.5 + 2.5 = 104.0, after it
    assert hard_age(cfg, 104.0, progress, aborted) == pytest.approx(cfg.hard_timeout)
    # aborted before its last progress (an abort never undoes progress made since)
    assert hard_age(cfg, 103.0, 102.0, 100.0) == pytest.approx(1.0)
