"""Fault simulation with Megatron Bridge's names (seed 003): make a rank hang or die, on
purpose, to rehearse detection and recovery.

``simulated_fault_type`` is ``rank_hung`` (the rank stops itself with SIGSTOP: no
heartbeat, no progress, exactly what a wedged GPU or a deadlock looks like from outside),
``rank_killed`` (SIGKILL to itself) or ``random`` (one of the two). The fault fires on
``simulated_fault_rank`` (chosen at random by rank 0 and broadcast when None) after
``simulated_fault_base_delay`` seconds plus a random extra of up to
``extra_delay_max`` seconds, from a daemon timer thread, so the training loop needs no
change. A ``fault_injected`` event is written first.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from . import events
from .config import ConfigError, require_choice, require_number

__all__ = ["FAULT_TYPES", "SimulatedFault", "SlowFault", "setup_simulated_fault"]

logger = logging.getLogger(__name__)

FAULT_TYPES = ("rank_hung", "rank_killed", "random")


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
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return rank, kind
    if dist.is_available() and dist.is_initialized():
        box: list[object] = [(rank, kind)]
        dist.broadcast_object_list(box, src=0)
        rank, kind = box[0]  # type: ignore[misc]
    return rank, kind


def _fire(kind: str, rank: int) -> None:
    events.emit("fault_injected", cause=kind, fault=kind, rank=rank)
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
                events.emit(
                    "fault_injected", step=step, cause="slow", fault="slow", factor=self.factor
                )
            time.sleep((self.factor - 1) * (time.perf_counter() - start))
