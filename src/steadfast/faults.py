"""Fault simulation: one vocabulary of faults (:class:`FaultKind`), a fire-once injector
for training loops (:func:`fail_at`), and Megatron Bridge's timer-based simulated faults
(seed 003, :func:`setup_simulated_fault`), to rehearse detection and recovery on purpose.

Every injected fault writes ``fault_injected`` (``fault``: the kind's name) and each kind
names the events expected to detect it (:attr:`FaultKind.detected_by`): the run report
(``steadfast report``) pairs each injected fault with its detection from that table.
The examples, the demo, the tests' training scripts and the in-process tests all inject
faults through :func:`fail_at`, so a fault has one name everywhere.

Megatron Bridge's simulated faults:

``simulated_fault_type`` is ``rank_hung`` (the rank stops itself with SIGSTOP: no
heartbeat, no progress, exactly what a wedged GPU or a deadlock looks like from outside),
``rank_killed`` (SIGKILL to itself) or ``random`` (one of the two). The fault fires on
``simulated_fault_rank`` (chosen at random by rank 0 and broadcast when None) after
``simulated_fault_base_delay`` seconds plus a random extra of up to
``extra_delay_max`` seconds, from a daemon timer thread, so the training loop needs no
change. A ``fault_injected`` event is written first.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import events
from .config import ConfigError, require_choice, require_number
from .dist import broadcast_object
from .events import Kind

__all__ = [
    "FAULT_TYPES",
    "FaultKind",
    "InjectedFault",
    "InjectedFaultError",
    "NODE_FAULTS",
    "SimulatedFault",
    "SlowFault",
    "fail_at",
    "parse_fault",
    "setup_simulated_fault",
]

logger = logging.getLogger(__name__)


class FaultKind(str, enum.Enum):
    """The faults steadfast rehearses, by the name every event and report uses."""

    #: SIGKILL to itself: a crash, an OOM kill, a lost GPU taking the process down
    RANK_KILLED = "rank_killed"
    #: stuck where it is, forever: in Python (a deadlock), or frozen with SIGSTOP
    #: (``freeze=True``: no thread of it runs, as with a wedged GPU); a timeout sees it
    RANK_HUNG = "rank_hung"
    #: an exception out of the training step (:class:`InjectedFaultError`)
    EXCEPTION = "exception"
    #: the process exits with a non-zero code (``os._exit``), no clean-up
    EXIT = "exit"
    #: the loss is NaN on this rank for ``length`` steps in a row
    NAN_BURST = "nan_burst"
    #: this rank's steps are ``seconds`` slower for ``length`` steps (a slow GPU)
    SLOW_RANK = "slow_rank"
    #: SIGTERM to itself: a preemption notice, the time limit of the job
    SIGTERM = "sigterm"
    #: a whole node gone at once (power, kernel panic, a GPU off the bus taking the
    #: host down): injected on the node (``scripts/nodes-localhost.sh kill``), not by
    #: a rank
    NODE_KILLED = "node_killed"
    #: a node's network gone while it runs on (``nodes-localhost.sh partition``)
    NODE_PARTITIONED = "node_partitioned"
    #: a node that fails its health check before a rendezvous
    #: (``--ft-node-health-check``, its checkpoint directory, its GPUs)
    NODE_UNHEALTHY = "node_unhealthy"
    #: one bit of one rank's state flips and the value stays finite (bad memory, a
    #: cosmic ray): :meth:`InjectedFault.check` returns True at the step and the loop
    #: flips it (``steadfast.sdc.flip_bit``); the replica check finds it (steadfast.sdc)
    BIT_FLIP = "bit_flip"

    @property
    def detected_by(self) -> tuple[str, ...]:
        """The event kinds that detect this fault (the first to follow it counts)."""
        return _DETECTED_BY[self]

    @property
    def recovery(self) -> str:
        """How a run recovers: ``restart`` (new processes, or the function restarted in
        process), ``in_place`` (skipped or rolled back within the loop), ``reported``
        (the run goes on; the report is the answer), ``stopped`` (the job stops with a
        verdict before the fault spreads: exit 80)."""
        return _RECOVERY[self]


_DETECTED_BY: dict[FaultKind, tuple[str, ...]] = {
    FaultKind.RANK_KILLED: (
        Kind.RANK_FAILED,
        Kind.INPROCESS_INTERRUPTED,
        Kind.INPROCESS_TERMINATED,
    ),
    FaultKind.RANK_HUNG: (Kind.RANK_HUNG, Kind.INPROCESS_INTERRUPTED),
    FaultKind.EXCEPTION: (Kind.RANK_FAILED, Kind.INPROCESS_INTERRUPTED),
    FaultKind.EXIT: (Kind.RANK_FAILED, Kind.INPROCESS_INTERRUPTED),
    FaultKind.NAN_BURST: (Kind.NAN_DETECTED, Kind.RERUN_RESULT_REJECTED),
    FaultKind.SLOW_RANK: (Kind.STRAGGLER_DETECTED,),
    FaultKind.SIGTERM: (Kind.SHUTDOWN_REQUESTED, Kind.PREEMPTION_SIGNAL),
    FaultKind.NODE_KILLED: (Kind.NODE_LOST,),
    FaultKind.NODE_PARTITIONED: (Kind.NODE_LOST, Kind.NODE_ISOLATED),
    FaultKind.NODE_UNHEALTHY: (Kind.NODE_UNHEALTHY,),
    FaultKind.BIT_FLIP: (Kind.SDC_DETECTED,),
}
#: Faults of a whole node: the node itself is the injector, not a rank's fail_at.
NODE_FAULTS = frozenset(
    {FaultKind.NODE_KILLED, FaultKind.NODE_PARTITIONED, FaultKind.NODE_UNHEALTHY}
)
_RECOVERY: dict[FaultKind, str] = {
    FaultKind.RANK_KILLED: "restart",
    FaultKind.RANK_HUNG: "restart",
    FaultKind.EXCEPTION: "restart",
    FaultKind.EXIT: "restart",
    FaultKind.NAN_BURST: "in_place",
    FaultKind.SLOW_RANK: "reported",
    FaultKind.SIGTERM: "restart",
    FaultKind.NODE_KILLED: "restart",
    FaultKind.NODE_PARTITIONED: "restart",
    FaultKind.NODE_UNHEALTHY: "restart",
    FaultKind.BIT_FLIP: "stopped",
}

#: Megatron Bridge's ``simulated_fault_type`` values (two of them are :class:`FaultKind`).
FAULT_TYPES = (FaultKind.RANK_HUNG.value, FaultKind.RANK_KILLED.value, "random")


def _kind(kind: FaultKind | str, field: str = "kind") -> FaultKind:
    if isinstance(kind, FaultKind):
        return kind
    try:
        return FaultKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise ConfigError(
            f"{field}: {kind!r} is not a fault kind; expected one of {known}"
        ) from None


class InjectedFaultError(RuntimeError):
    """The exception a :attr:`FaultKind.EXCEPTION` fault raises."""


class InjectedFault:
    """One planned fault (made by :func:`fail_at`): on ``rank`` at ``step``, once.

    Call :meth:`check` at the point of every step where the fault should strike. The
    first time the fault's rank reaches its step it writes ``fault_injected`` and acts:
    a process fault (killed, hung, exception, exit, SIGTERM) happens right there; a NaN
    burst or a slow rank makes :meth:`check` return True for ``length`` calls (this one
    and the next ones, whatever their step: a rolled-back step is still faulty), and the
    loop applies it (a NaN loss, ``time.sleep(fault.seconds)``).

    "Once" is once per run when ``once_dir`` is given (a marker file per fault, made
    with ``O_EXCL``: the re-run of the step after an in-job restart or a requeue is
    clean), else once per process (enough for in-process restarts, where the process
    lives on).
    """

    def __init__(
        self,
        rank: int,
        step: int,
        kind: FaultKind | str,
        *,
        length: int = 1,
        seconds: float = 0.0,
        exit_code: int = 3,
        freeze: bool = False,
        once_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.kind = _kind(kind)
        if self.kind in NODE_FAULTS:
            raise ConfigError(
                f"fail_at.kind: {self.kind.value} is a fault of a whole node, injected on "
                "the node, not by a rank (scripts/nodes-localhost.sh kill or partition DIR "
                "NODE; a failing --ft-node-health-check CMD)"
            )
        self.freeze = bool(freeze)
        self.rank = require_number("fail_at.rank", rank, minimum=0, integer=True)
        self.step = require_number("fail_at.step", step, minimum=0, integer=True)
        self.length = require_number("fail_at.length", length, minimum=1, integer=True)
        self.seconds = float(require_number("fail_at.seconds", seconds, minimum=0))
        self.exit_code = require_number("fail_at.exit_code", exit_code, minimum=1, integer=True)
        if self.exit_code > 255:
            raise ConfigError(f"fail_at.exit_code: {exit_code} is not an exit status (1..255)")
        if self.length != 1 and self.kind not in (FaultKind.NAN_BURST, FaultKind.SLOW_RANK):
            raise ConfigError(f"fail_at.length: a {self.kind.value} fault has no length")
        if freeze and self.kind is not FaultKind.RANK_HUNG:
            raise ConfigError(
                f"fail_at.freeze: only a rank_hung fault freezes, not {self.kind.value}"
            )
        self.once_dir = Path(once_dir) if once_dir is not None else None
        self.fired = False
        self._left = 0

    def __repr__(self) -> str:
        return f"fail_at({self.rank}, {self.step}, {self.kind.value!r})"

    @property
    def marker(self) -> str:
        """The name of this fault's marker file in ``once_dir``."""
        return f"{self.kind.value}@{self.rank}:{self.step}"

    def _first_time(self) -> bool:
        if self.fired:
            return False
        self.fired = True
        if self.once_dir is None:
            return True
        self.once_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.once_dir / self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False  # an earlier process of this run fired it
        return True

    def check(self, step: int, rank: int | None = None) -> bool:
        """Strike if this is the fault's rank (``rank``, default ``$RANK``) and step, the
        first time; True while a NaN burst or a slowdown lasts (see the class)."""
        if self._left > 0:
            self._left -= 1
            return True
        me = int(os.environ.get("RANK", "0")) if rank is None else rank
        if me != self.rank or step != self.step or not self._first_time():
            return False
        events.emit(
            "fault_injected", step=step, cause=self.kind.value, fault=self.kind.value, rank=me
        )
        logger.warning("injecting %s on rank %d at step %d", self.kind.value, me, step)
        _strike(self.kind, self.exit_code, self.freeze, f"on rank {me} at step {step}")
        self._left = self.length - 1
        return True


def _strike(kind: FaultKind, exit_code: int, freeze: bool, where: str) -> None:
    """The process-level part of a fault (NaN bursts and slowdowns have none)."""
    if kind is FaultKind.RANK_KILLED:
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind is FaultKind.RANK_HUNG:
        if freeze:  # no thread runs; a SIGTERM stays pending (Megatron's rank_hung)
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # stuck in Python: only a timeout (or an async exception) ends it
            time.sleep(0.05)
    elif kind is FaultKind.EXCEPTION:
        raise InjectedFaultError(f"injected fault {where}: an exception in the training step")
    elif kind is FaultKind.EXIT:
        os._exit(exit_code)
    elif kind is FaultKind.SIGTERM:
        os.kill(os.getpid(), signal.SIGTERM)


def fail_at(rank: int, step: int, kind: FaultKind | str, **options: Any) -> InjectedFault:
    """Plan fault ``kind`` on ``rank`` at ``step`` (fire-once: see :class:`InjectedFault`);
    the loop calls ``fault.check(step)`` at the point where it should strike. Options:
    ``length`` (steps a NaN burst or slowdown lasts), ``seconds`` (a slow step's extra),
    ``exit_code`` (of an ``exit`` fault), ``freeze`` (a hang by SIGSTOP), ``once_dir``
    (once per run, not per process)."""
    return InjectedFault(rank, step, kind, **options)


def parse_fault(spec: str, **options: Any) -> InjectedFault:
    """A fault from a command-line spec ``KIND:RANK:STEP[:LENGTH]`` (e.g.
    ``rank_killed:1:8``, ``nan_burst:1:23:3``); ``options`` go to :func:`fail_at`.
    A malformed spec raises :class:`~steadfast.ConfigError` naming it."""
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise ConfigError(f"fault {spec!r}: expected KIND:RANK:STEP[:LENGTH]")
    kind = _kind(parts[0], f"fault {spec!r}")
    try:
        rank, step, *rest = (int(p) for p in parts[1:])
    except ValueError:
        raise ConfigError(f"fault {spec!r}: RANK, STEP and LENGTH must be integers") from None
    if rest:
        options = {**options, "length": rest[0]}
    try:
        return fail_at(rank, step, kind, **options)
    except ConfigError as exc:
        raise ConfigError(f"fault {spec!r}: {exc}") from None


@dataclass(frozen=True)
class SimulatedFault:
    """The fault that will fire: on which rank, what, and after how long."""

    rank: int
    fault_type: str
    delay: float
    timer: threading.Timer | None

    def cancel(self) -> None:
        """Disarm the fault (e.g. the run finished first)."""
        if self.timer is not None:
            self.timer.cancel()


def _agree(
    rank_choice: int | None, type_choice: str, world: int, rng: random.Random
) -> tuple[int, str]:
    """Rank 0's choice of rank and type, broadcast so every rank knows the same fault."""
    rank = rank_choice if rank_choice is not None else rng.randrange(world)
    kind = rng.choice(FAULT_TYPES[:2]) if type_choice == "random" else type_choice
    rank, kind = broadcast_object((rank, kind), src=0)
    return rank, kind


def _fire(kind: str, rank: int) -> None:
    events.emit("fault_injected", cause=kind, fault=FaultKind(kind).value, rank=rank)
    logger.warning("FT: Simulating fault: %s; rank to fail: %d", kind, rank)
    os.kill(os.getpid(), signal.SIGSTOP if kind == "rank_hung" else signal.SIGKILL)


def setup_simulated_fault(
    simulate_fault: bool = False,
    simulated_fault_type: str = "random",
    simulated_fault_rank: int | None = None,
    simulated_fault_base_delay: float = 0,
    extra_delay_max: float = 1.0,
    seed: int | None = None,
) -> SimulatedFault | None:
    """Arm a simulated fault (collective under torch.distributed: every rank calls it).

    Returns the fault (on every rank, so all know which rank will fail), or None when
    ``simulate_fault`` is false. The timer runs only on the failing rank.
    """
    if not simulate_fault:
        return None
    require_choice("simulated_fault_type", simulated_fault_type, FAULT_TYPES)
    base = float(
        require_number("simulated_fault_base_delay", simulated_fault_base_delay, minimum=0)
    )
    extra_max = float(require_number("extra_delay_max", extra_delay_max, minimum=0))
    rank_env = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if simulated_fault_rank is not None:
        require_number("simulated_fault_rank", simulated_fault_rank, minimum=0, integer=True)
        if simulated_fault_rank >= world:
            raise ConfigError(
                f"simulated_fault_rank: {simulated_fault_rank} is not a rank of this "
                f"{world}-rank job"
            )
    rng = random.Random(seed)
    rank, kind = _agree(simulated_fault_rank, simulated_fault_type, world, rng)
    delay = base + rng.uniform(0, extra_max)
    timer = None
    if rank == rank_env:
        timer = threading.Timer(delay, _fire, args=(kind, rank))
        timer.name = "steadfast-simulated-fault"
        timer.daemon = True
        timer.start()
    logger.info("simulated fault armed: %s on rank %d after %.2fs", kind, rank, delay)
    return SimulatedFault(rank=rank, fault_type=kind, delay=delay, timer=timer)


class SlowFault:
    """A simulated straggler: from ``start_step`` on, ``rank``'s steps take ``factor``
    times as long (the step runs, then the rank sleeps for the difference).

    ``with slow.step(step): train_step()`` on every rank; only ``rank`` is slowed.
    """

    def __init__(self, factor: float = 1.5, rank: int = 0, start_step: int = 0) -> None:
        self.factor = float(require_number("SlowFault.factor", factor, minimum=1))
        self.rank = require_number("SlowFault.rank", rank, minimum=0, integer=True)
        self.start_step = require_number(
            "SlowFault.start_step", start_step, minimum=0, integer=True
        )
        self._announced = False

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run one step, slowed on the faulty rank once ``start_step`` is reached."""
        active = step >= self.start_step and int(os.environ.get("RANK", "0")) == self.rank
        start = time.perf_counter()
        yield
        if active:
            if not self._announced:
                self._announced = True
                slow = FaultKind.SLOW_RANK.value
                events.emit("fault_injected", step=step, cause=slow, fault=slow, factor=self.factor)
            time.sleep((self.factor - 1) * (time.perf_counter() - start))
