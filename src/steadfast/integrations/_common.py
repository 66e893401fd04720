"""What the framework callbacks share, without importing any framework: the rank's
monitoring (client, sections, step events, calculated timeouts), the NaN guard and its
rollback, and the straggler step timer. ``lightning.py`` and ``transformers.py`` only
map their framework's hooks onto these."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import events
from ..monitor import HB_TABLE_ENV, RankMonitorClient, load_ft_state, save_ft_state
from ..nan_detector import NaNDetector
from ..straggler.manager import NVRxStragglerDetectionConfig, StragglerDetectionManager

#: The calculated timeouts' file in the run's folder (NVRx's name).
FT_STATE_FILE = "_ft_state.json"

#: The exit status of a rank stopped for stragglers: "resume on other hardware" (the
#: re-run state machine's 16), which ``steadfast launch`` does not restart in place and
#: its Slurm script requeues; a restart on the same slow GPU would find it again.
EXIT_STRAGGLERS = 16


_active: Monitoring | None = None  # the running callback's, for helpers without one


@contextlib.contextmanager
def checkpointing() -> Iterator[None]:
    """The ``checkpointing`` section around checkpoint work a callback does outside the
    framework's own save (sealing a checkpoint, waiting for a background write), when a
    FaultToleranceCallback is monitoring this rank; nothing otherwise."""
    monitoring = _active
    if monitoring is None or "checkpointing" in monitoring._open:
        yield
        return
    monitoring.open("checkpointing")
    try:
        yield
    finally:
        monitoring.close("checkpointing")


class Monitoring:
    """One rank's :class:`~steadfast.monitor.RankMonitorClient` (only under ``steadfast
    launch``, which provides the heartbeat table), the sections open now, and the
    events of the training steps. Section names may be opened and closed in any order:
    opening an open one or closing a closed one does nothing."""

    def __init__(self, calculate_timeouts: bool) -> None:
        self.calculate_timeouts = calculate_timeouts
        self.client: RankMonitorClient | None = None
        self._open: set[str] = set()
        self._step_began: float | None = None

    def start(self, state_file: Path) -> None:
        """Start monitoring with the timeouts an earlier run calculated, and open
        ``setup``."""
        global _active
        if os.environ.get(HB_TABLE_ENV) and self.client is None:
            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            load_ft_state(self.client, state_file)
        _active = self
        self.open("setup")

    def open(self, name: str) -> None:
        if name not in self._open:
            self._open.add(name)
            if self.client is not None:
                self.client.start_section(name)

    def close(self, name: str) -> None:
        if name in self._open:
            self._open.discard(name)
            if self.client is not None:
                self.client.end_section(name)

    def step_begin(self, *ended: str) -> None:
        """A training step starts: the sections ``ended`` (and ``setup``) are over, a
        heartbeat, the ``step`` section."""
        for name in ("setup", *ended):
            self.close(name)
        if self.client is not None:
            self.client.send_heartbeat()
        self.open("step")
        self._step_began = time.monotonic()

    def step_end(self, step: int, **fields: Any) -> None:
        """The step ended: ``step`` closed, a ``step_done`` event (with its duration)."""
        self.close("step")
        began, self._step_began = self._step_began, None
        events.emit(
            "step_done",
            step=step,
            seconds=round(time.monotonic() - began, 6) if began is not None else None,
            **fields,
        )

    def calculate(self, state_file: Path, write: bool) -> None:
        """The ``step`` timeout from the steps seen on every rank (a collective, once
        enough were seen); ``write`` (one rank) keeps it in ``state_file``."""
        if self.client is None or not self.calculate_timeouts:
            return
        self.client.calculate_and_set_section_timeouts(
            ["step"], calc_out_of_section=False, skip_if_not_ready=True
        )
        if write:
            state_file.parent.mkdir(parents=True, exist_ok=True)
            save_ft_state(self.client, state_file)

    def stop(self) -> None:
        """Every section closed and monitoring shut down (a closed row: not a hang)."""
        global _active
        if _active is self:
            _active = None
        for name in list(self._open):
            self.close(name)
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None


class NaNRollback(RuntimeError):
    """NaN/Inf gradients for ``max_consecutive`` steps in a row: the rank stops so that
    the launcher restarts every rank from the latest checkpoint."""


class NaNGuard:
    """:class:`~steadfast.NaNDetector` on the gradients before an optimizer step, and
    :class:`NaNRollback` once it recommends rolling back."""

    def __init__(self, action: str, max_consecutive: int) -> None:
        self.detector = NaNDetector(action=action, max_consecutive=max_consecutive)

    def check(self, model: Any, step: int) -> None:
        """Check ``model``'s gradients on every rank at once (a collective)."""
        if self.detector.check_gradients(model, step):
            return
        if self.detector.should_rollback:  # the detector reported it (an event)
            raise NaNRollback(
                f"NaN/Inf gradients for {self.detector.state.consecutive_nans} steps in a "
                f"row (max_consecutive={self.detector.max_consecutive}): restarting from "
                "the latest checkpoint"
            )

    @property
    def in_streak(self) -> bool:
        """The last step's gradients were not finite."""
        return self.detector.state.consecutive_nans > 0


class StepTimer:
    """The straggler detector of ``config`` (NVRx's fields), its ``train_step`` section,
    and the periodic check (a collective: every rank, the same step).

    The section times the training forwards of the module given to
    :meth:`time_forwards` (where no collective makes a fast rank wait for a slow one, so
    the *relative* scores single out a slow rank), and whole steps (:meth:`begin` to
    :meth:`end`) when no module was given or a step ran no forward it could see (a
    compiled one): a whole step's gradient all-reduce makes every rank wait for the
    slowest, and what a rank does between steps alone (rank 0 writing a checkpoint)
    lands in the next step of the ranks that wait for it."""

    def __init__(self, config: NVRxStragglerDetectionConfig) -> None:
        if not (config.calc_relative_gpu_perf or config.calc_individual_gpu_perf):
            raise ValueError(
                "calc_relative_gpu_perf, calc_individual_gpu_perf: at least one must be True"
            )
        self.manager = StragglerDetectionManager(config)
        self._timing: Any = None  # the whole step being timed
        self._forward: Any = None  # the forward being timed
        self._forwards = 0  # forwards timed in this step
        self._whole = True  # time whole steps (no forward seen in the last one)
        self._hooks: list[Any] = []

    def time_forwards(self, module: Any) -> None:
        """Time ``module``'s training forwards (hooks, removed by :meth:`close`)."""
        if not self._hooks:
            self._hooks = [
                module.register_forward_pre_hook(self._forward_begins),
                module.register_forward_hook(self._forward_ends, always_call=True),
            ]

    def close(self) -> None:
        """Remove the forward hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _forward_begins(self, module: Any, args: Any) -> None:
        import torch

        if torch.compiler.is_compiling() or self._forward is not None:
            return  # traced by a compile, or a forward nested in the timed one
        if module.training and torch.is_grad_enabled():  # not an evaluation's forward
            self._forward = self.manager.detector.detection_section("train_step")
            self._forward.__enter__()

    def _forward_ends(self, module: Any, args: Any, output: Any) -> None:
        timing, self._forward = self._forward, None
        if timing is not None:
            timing.__exit__(None, None, None)
            self._forwards += 1

    def begin(self) -> None:
        """The step starts: time it whole if its forwards cannot be."""
        self._forwards = 0
        if self._whole:
            self._timing = self.manager.detector.detection_section("train_step")
            self._timing.__enter__()

    def end(self, step: int) -> bool:
        """The step ended: the report if one is due; True when every rank should stop."""
        timing, self._timing = self._timing, None
        if timing is not None and not self._forwards:
            timing.__exit__(None, None, None)
        self._whole = not self._hooks or not self._forwards
        return self.manager.check(step)
