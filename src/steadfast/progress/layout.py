"""The progress area of a heartbeat-table row: what a worker's hooks write (steps, marks,
forward times, the stack its thread sampled) and the launcher reads.

The area is the row's second page (:data:`steadfast.monitor.table.PROGRESS_OFFSET`):
float64 slots, two rings (step end times, forward durations) and a text area for the
sampled stack. One writer per slot: the worker writes everything but :data:`ASK`, which
the launcher writes. The hot path writes plain slots in an order a reader can rely on
(a ring entry before the count that publishes it), so it needs no lock.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..sdc.layout import BASE as REPLICA_BASE
from ..sdc.layout import END as REPLICA_END

__all__ = [
    "ASK_PREFIX",
    "COLLECTIVES_DONE",
    "ENDED",
    "FINISHED",
    "Progress",
    "ask_path",
    "read",
    "read_stack",
]

ASK_PREFIX = "steadfast-hbask-"
_TABLE_PREFIX = "steadfast-hb-"


class Rows(Protocol):
    """What the launcher's side of progress reads of the node's heartbeat table
    (:class:`steadfast.monitor.table.HeartbeatTable`), without importing it."""

    @property
    def path(self) -> Path: ...

    @property
    def rows(self) -> int: ...

    def progress_area(self, row: int) -> tuple[Any, memoryview]: ...


def ask_path(table: str | os.PathLike[str], row: int) -> Path:
    """Row ``row``'s ask channel (a FIFO beside the heartbeat table, made with it): the
    launcher writes a byte to it to have the rank's progress thread sample its stack."""
    path = Path(table)
    return path.with_name(f"{ASK_PREFIX}{path.name.removeprefix(_TABLE_PREFIX)}-{row}")


PID = 0  # the worker's pid once its hooks are in (0: none)
STEPS = 1  # iterations counted
MARK = 2  # monotonic time of the last sign of progress (a step, a forward's start or end)
FIRST_STEP = 3  # monotonic time the first iteration ended
LAST_STEP = 4  # monotonic time the last iteration ended
LONGEST = 5  # the longest interval between two marks after the first iteration
INTERVALS = 6  # intervals counted in LONGEST
FORWARDS = 7  # forward durations published into FWD_RING
FLAGS = 8  # FLAG_* bits
STEP_BASE = 9  # 1 + the script's own index of iteration 1 (an optimizer's step count); 0: unknown
ASK = 10  # the launcher's stack requests (it increments; the worker's thread answers)
ANSWER = 11  # the request the stack in the text area answers
ANSWER_AT = 12  # monotonic time of that sample
TEXT_LEN = 13  # bytes of the stack text
FINISHED = 14  # monotonic time the script finished (__main__ returned, sys.exit(0)); 0: not yet
ENDED = 15  # monotonic time the script ended another way (it raised, sys.exit(N)); 0: not yet
STEP_RING = 16  # STEP_RING + (n % RING): the monotonic end of iteration n
RING = 64
FWD_RING = STEP_RING + RING  # FWD_RING + (n % RING): the n-th forward's seconds
# the phases of the worker's start (steadfast.progress.phases), until its first iteration
PH_STARTED = FWD_RING + RING  # monotonic time the hooks went in (the process's start)
PH_WALL = PH_STARTED + 1  # time.time() - time.monotonic() in the worker at that moment
PH_IMPORTS = PH_STARTED + 2  # seconds in the main thread's outermost imports
PH_PG = PH_STARTED + 3  # seconds in init_process_group (every call)
PH_LOAD = PH_STARTED + 4  # seconds loading a checkpoint (torch.load, steadfast's loads)
PH_COMPILE = PH_STARTED + 5  # seconds in torch.compile's compilations
PH_BATCH = PH_STARTED + 6  # seconds getting batches from a DataLoader
PH_FIRST_FORWARD = PH_STARTED + 7  # monotonic: the top module's first forward began
PH_LOAD_AT = PH_STARTED + 8  # PH_LOAD, PH_COMPILE, PH_BATCH as they were at that moment
PH_COMPILE_AT = PH_STARTED + 9
PH_BATCH_AT = PH_STARTED + 10
PH_DONE = PH_STARTED + 11  # 1: the first iteration ended and the phases are final
PH_END = PH_STARTED + 12
# monotonic time the script's destroy_process_group() of the default group returned: its
# collectives are over (steadfast.launcher.worker_end); 0: not yet
COLLECTIVES_DONE = PH_END
TEXT_OFFSET = 2048  # bytes: the stack text, frames outermost first, one per line
TEXT_BYTES = 2048

FLAG_CUDA = 1  # the top module's parameters are on a CUDA device
FLAG_OWN_STEPS = 2  # the script emits its own step_done: its steps are its own
FLAG_DDP = 4  # the top module is DistributedDataParallel's (its backward holds collectives)
FLAG_FORWARD_STEPS = 8  # no optimizer step seen outside compiled code: forwards are counted
FLAG_TOP = 16  # the top module is found and hooked
FLAG_OWN_STRAGGLERS = 32  # the script runs steadfast's straggler Detector: its reports rule

assert COLLECTIVES_DONE < TEXT_OFFSET // 8
# the replica checks' area (steadfast.sdc.layout) lies between these slots and the text
assert COLLECTIVES_DONE < REPLICA_BASE and REPLICA_END <= TEXT_OFFSET // 8


@dataclass(frozen=True)
class Progress:
    """One read of a row's progress area."""

    pid: int
    steps: int
    mark: float
    first_step: float
    last_step: float
    longest: float
    intervals: int
    forwards: int
    flags: int
    step_base: int | None

    @property
    def attached(self) -> bool:
        return self.pid > 0


def read(slots: Any) -> Progress:
    """A read of the slots (no lock: each slot is one aligned store)."""
    base = slots[STEP_BASE]
    return Progress(
        pid=int(slots[PID]),
        steps=int(slots[STEPS]),
        mark=slots[MARK],
        first_step=slots[FIRST_STEP],
        last_step=slots[LAST_STEP],
        longest=slots[LONGEST],
        intervals=int(slots[INTERVALS]),
        forwards=int(slots[FORWARDS]),
        flags=int(slots[FLAGS]),
        step_base=int(base) - 1 if base > 0 and math.isfinite(base) else None,
    )


def step_times(slots: Any, after: int, upto: int) -> list[tuple[int, float]]:
    """``(n, monotonic end)`` of iterations ``after+1 .. upto`` still in the ring."""
    first = max(after + 1, upto - RING + 1, 1)
    return [(n, slots[STEP_RING + n % RING]) for n in range(first, upto + 1)]


def forward_times(slots: Any, after: int, upto: int) -> list[float]:
    """The forward durations ``after+1 .. upto`` still in the ring."""
    first = max(after + 1, upto - RING + 1, 1)
    return [slots[FWD_RING + n % RING] for n in range(first, upto + 1)]


def read_stack(slots: Any, text: memoryview) -> str:
    """The stack text of the last answer."""
    n = max(0, min(int(slots[TEXT_LEN]), TEXT_BYTES))
    return bytes(text[TEXT_OFFSET : TEXT_OFFSET + n]).decode(errors="replace")
