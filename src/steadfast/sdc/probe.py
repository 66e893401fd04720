"""A worker's side of the replica check: after every ``every``-th optimizer step of a
DDP model, the fingerprint of one chunk of its replicated state (:mod:`.fingerprint`),
published in the worker's row (:mod:`.layout`) for the launcher to compare with the
other replicas' (:mod:`.board`). Nothing travels over the script's process group.

Started by the progress hooks (:mod:`steadfast.progress.probe`) when they find the
script's top module is a ``DistributedDataParallel``: its replicas are the ranks of its
process group. Nothing else is compared: FSDP shards, tensor- or pipeline-parallel
pieces and models that differ per rank are not DDP's replicas, and buffers (BatchNorm's
running statistics) are left out. The optimizer checked is the first one that steps the
model's parameters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import deque
from dataclasses import replace
from typing import Any

from . import layout
from .fingerprint import ReplicaState, as_unsigned, cpu_crc, device_hash, group_key

__all__ = [
    "CLEAN_ENV",
    "ReplicaProbe",
    "checking",
    "clean_step",
    "note_save",
    "proven_step",
    "settings",
    "start",
]

logger = logging.getLogger(__name__)

_CONFIG_ENV = "STEADFAST_FT_CONFIG"  # = steadfast.monitor.FT_CONFIG_ENV
DEFAULT_EVERY = 10
#: Set by the launcher for the workers it restarts after a verdict: the newest
#: checkpoint step proven clean (-1: none); CheckpointManager restores nothing newer.
CLEAN_ENV = "STEADFAST_CLEAN_STEP"

_active: ReplicaProbe | None = None  # this worker's, once its DDP model was found


def note_save(step: int) -> None:
    """steadfast's CheckpointManager captured checkpoint ``step`` now (a save or a
    snapshot): noted with the optimizer steps counted so far, so that the launcher
    knows which checkpoints a later agreeing check proved clean."""
    if _active is not None:
        _active.note_save(step)


def checking() -> bool:
    """Whether this worker's replicas are checked (a DDP model under steadfast launch)."""
    return _active is not None


def proven_step() -> int | None:
    """The newest checkpoint step the launcher's checks proved clean so far (its mark in
    this worker's row), or None: the one checkpoint retention must keep."""
    if _active is None:
        return None
    value = int(_active.slots[layout.PROVEN])
    return value - 1 if value > 0 else None


def clean_step(env: Any = None) -> int | None:
    """The bound the launcher set after a verdict (:data:`CLEAN_ENV`), or None."""
    value = (os.environ if env is None else env).get(CLEAN_ENV)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${CLEAN_ENV}: {value!r} is not a step") from None


def settings(env: Any = None) -> tuple[bool, int, int]:
    """``(on, every, budget)`` from the launcher's FT config in the environment."""
    from .fingerprint import DEFAULT_BUDGET

    env = os.environ if env is None else env
    try:
        config = json.loads(env.get(_CONFIG_ENV) or "{}")
    except ValueError:
        config = {}
    return (
        bool(config.get("replica_check", True)),
        int(config.get("replica_check_every", DEFAULT_EVERY)),
        int(config.get("replica_check_bytes", DEFAULT_BUDGET)),
    )


def start(slots: Any, ddp: Any) -> ReplicaProbe | None:
    """The replica probe of ``ddp`` (a ``DistributedDataParallel``) in a row's ``slots``,
    or None: checks off, or no process group to name the replicas by."""
    on, every, budget = settings()
    if not on:
        return None
    try:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(ddp.process_group)
    except Exception as exc:
        logger.debug("replica check off: no process group (%s)", exc)
        return None
    if len(ranks) < 2:
        return None
    global _active
    _active = ReplicaProbe(slots, ddp.module, group_key(ranks), every, budget)
    return _active


class ReplicaProbe:
    """The checks of one DDP model (see the module docstring)."""

    def __init__(self, slots: Any, module: Any, group: int, every: int, budget: int) -> None:
        self.slots = slots
        self.module = module
        self.every = max(1, int(every))
        self.budget = budget
        self.group = group
        self.optimizer: Any = None
        self.state: ReplicaState | None = None
        self.count = 0  # the chosen optimizer's steps since the process started
        self.published = 0
        self.pending: deque[tuple[layout.Entry, Any, Any]] = deque()  # device hashes in flight
        self.saves = 0
        self.last_saved = -1  # the newest checkpoint step noted
        self.checked = -1  # the count of the last published check
        self._params: set[int] = {id(p) for p in module.parameters()}
        slots[layout.GROUP] = float(group)

    def after_step(self, optimizer: Any, step_base: int | None) -> None:
        """An optimizer step ended (the outermost call): check the state every
        ``every``-th step of the optimizer that steps this model."""
        if self.optimizer is None:
            if not self._owns(optimizer):
                return
            self.optimizer = optimizer
            self.state = ReplicaState(self.module, optimizer, self.budget)
        elif optimizer is not self.optimizer:
            return
        self.count += 1
        if self.pending:
            self._collect()
        if self.count % self.every:
            return
        assert self.state is not None
        tensors = self.state.tensors()
        if not tensors:
            return
        span = self.state.span(self.count // self.every, tensors)
        step = self.count if step_base is None else step_base + self.count - 1
        self.slots[layout.TOTAL] = float(span.total)
        self.slots[layout.CHUNKS] = float(span.chunks)
        if tensors[0].device.type == "cpu":
            fp = cpu_crc(tensors, span)
            self._publish(layout.Entry(self.count, span.chunk, fp, step, self.last_saved))
            return
        import torch

        value = device_hash(tensors, span)
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(value, non_blocking=True)
        event: Any = torch.cuda.Event
        done = event()
        done.record()
        entry = layout.Entry(self.count, span.chunk, 0, step, self.last_saved)
        self.pending.append((entry, host, done))

    def note_save(self, step: int) -> None:
        """A checkpoint of the state after ``count`` optimizer steps: the next check
        (or the last one, where it checked that very state) proves it clean."""
        self.saves += 1
        self.last_saved = int(step)
        checked_now = self.published and self.checked == self.count
        layout.note_save(self.slots, self.published if checked_now else 0, self.saves, step)

    def _owns(self, optimizer: Any) -> bool:
        with contextlib.suppress(Exception):
            for group in optimizer.param_groups:
                if any(id(p) in self._params for p in group["params"]):
                    return True
        return False

    def _collect(self) -> None:
        """Publish the device hashes that are ready (``query``: never a wait)."""
        while self.pending and self.pending[0][2].query():
            entry, host, _ = self.pending.popleft()
            fp = as_unsigned(int(host)) >> 12  # 52 bits: exact in a float64 slot
            self._publish(replace(entry, fp=fp))

    def _publish(self, entry: layout.Entry) -> None:
        self.published += 1
        self.checked = entry.count
        layout.publish(self.slots, self.published, entry)
