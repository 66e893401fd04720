"""steadfast for the Hugging Face ``Trainer``: callbacks that give a ``trainer.train()``
run under ``steadfast launch`` what ``examples/train.py`` has by hand (``pip install
steadfast[transformers]``).

    trainer = Trainer(model, args, train_dataset=data, callbacks=[
        FaultToleranceCallback(), GracefulShutdownCallback(), NaNCallback()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))

:class:`FaultToleranceCallback`:

- **heartbeats and sections** through :class:`~steadfast.monitor.RankMonitorClient`:
  ``setup`` from the Trainer's creation to the first step, ``step`` around each
  optimizer step (its gradient-accumulation micro-batches included), ``evaluation``
  and ``checkpointing`` from the step that asks for them until the Trainer reports them
  done (``on_evaluate``, ``on_save``: the Trainer has no hook before a save);
- **calculated timeouts**: at the end of each epoch and of training, the ``step``
  section's timeout from the steps seen on every rank, kept in
  ``output_dir/_ft_state.json`` and loaded by the next run;
- **events** for ``steadfast report``: ``job_start`` once the Trainer restored its state
  (with the checkpoint it resumed from) and ``step_done`` per optimizer step.

:class:`GracefulShutdownCallback`: SIGTERM or SIGUSR1 on any rank makes every rank stop
after the same step (:class:`~steadfast.ShutdownHandler` with ``agree=True``): the
Trainer saves a checkpoint there, and once it is written every rank exits 0, so that
the requeued job resumes from it (the Trainer skips the batches the epoch already
trained: a mid-epoch resume is exact).

:class:`NaNCallback`: NaN/Inf gradients checked before each optimizer step on every
rank at once (:class:`~steadfast.NaNDetector`); ``skip`` drops the gradients so the
step changes nothing, and no checkpoint is saved while NaN steps run in a row, so
that after ``max_consecutive`` of them the ranks raise :class:`NaNRollback` and the
launcher restarts them from the latest checkpoint *before* the burst.

:class:`StragglerDetectionCallback` (NVRx's Lightning callback's arguments): every
optimizer step timed on every rank (a callback sees only whole steps: their gradient
all-reduce makes every rank wait for the slowest, so a slow rank lowers every rank's
*individual* score, against its own best, while the *relative* scores, which compare
ranks, cannot single it out as they can under Lightning, where the forward is timed),
a report every ``report_time_interval`` seconds (``straggler_report`` /
``straggler_detected`` events), and with ``stop_if_detected``
the Trainer saves a checkpoint at that step and every rank exits 16 ("resume on other
hardware": ``steadfast launch`` does not restart it in place, its Slurm script requeues).

Outside ``steadfast launch`` the monitoring is off and the events are still written.
Only the Trainer's public callback interface is used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from .. import events
from ..straggler.manager import NVRxStragglerDetectionConfig
from ._common import (
    EXIT_STRAGGLERS,
    FT_STATE_FILE,
    Monitoring,
    NaNGuard,
    NaNRollback,
    StepTimer,
)

__all__ = [
    "FaultToleranceCallback",
    "GracefulShutdownCallback",
    "NaNCallback",
    "NaNRollback",
    "StragglerDetectionCallback",
]


class FaultToleranceCallback(TrainerCallback):
    """Heartbeats, sections, calculated timeouts and the run's events for a Hugging
    Face ``Trainer`` (see the module's description). ``calculate_timeouts``: set the
    ``step`` section's timeout from the steps seen; ``exp_dir``: where
    ``_ft_state.json`` is kept (default: the Trainer's ``output_dir``)."""

    def __init__(
        self, calculate_timeouts: bool = True, exp_dir: str | os.PathLike[str] | None = None
    ) -> None:
        self.exp_dir = Path(exp_dir) if exp_dir is not None else None
        self.monitoring = Monitoring(calculate_timeouts)

    def _state_file(self, args: TrainingArguments) -> Path:
        return (self.exp_dir or Path(str(args.output_dir))) / FT_STATE_FILE

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Start monitoring (under ``steadfast launch``) with the timeouts an earlier run
        calculated; ``job_start`` with the state the Trainer restored."""
        self.monitoring.start(self._state_file(args))
        events.job_start(int(state.global_step), int(args.world_size), _resumed_from(args, state))

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.monitoring.step_begin("evaluation", "checkpointing")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.monitoring.step_end(int(state.global_step) - 1)
        if control.should_evaluate:  # the Trainer evaluates, then saves, after this hook
            self.monitoring.open("evaluation")
        elif control.should_save:
            self.monitoring.open("checkpointing")

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.monitoring.close("evaluation")
        if control.should_save:
            self.monitoring.open("checkpointing")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.monitoring.close("checkpointing")

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.monitoring.calculate(self._state_file(args), state.is_world_process_zero)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Calculate the timeouts a last time and stop monitoring (a closed row: not a
        hang)."""
        self.monitoring.calculate(self._state_file(args), state.is_world_process_zero)
        self.monitoring.stop()


class GracefulShutdownCallback(TrainerCallback):
    """Stop every rank after the same step on SIGTERM/SIGUSR1, with a checkpoint, and
    exit 0 (see the module's description). ``timeout_sec``: the forced exit if the
    save hangs."""

    def __init__(self, timeout_sec: float = 600.0) -> None:
        from ..signals import ShutdownHandler

        self.handler = ShutdownHandler(timeout_sec=timeout_sec, agree=True)
        self._registered = False
        self._stopping = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not self._registered:
            self.handler.register()
            self._registered = True

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """After every step, on every rank (a collective): stop here if any rank was
        signalled; the Trainer saves right after this hook."""
        if self._registered and self.handler.should_shutdown(int(state.global_step)):
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """The checkpoint is written: leave now, exit 0, for the requeued job."""
        if self._stopping:
            self.handler.finish()
            self._registered = False
            raise SystemExit(0)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._registered:
            self.handler.unregister()
            self._registered = False


class NaNCallback(TrainerCallback):
    """NaN/Inf gradients checked before each optimizer step (see the module's
    description). ``action``: ``skip`` (the default), ``warn`` or ``raise``."""

    def __init__(self, action: str = "skip", max_consecutive: int = 5) -> None:
        self.guard = NaNGuard(action, max_consecutive)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        model = kw.get("model")
        if model is not None:
            self.guard.check(model, int(state.global_step))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """No checkpoint in the middle of a NaN streak: a rollback must land before it
        (this runs after the Trainer's own flow callback set ``should_save``)."""
        if self.guard.in_streak:
            control.should_save = False


def _resumed_from(args: TrainingArguments, state: TrainerState) -> str | None:
    """The checkpoint the Trainer resumed from (its newest in ``output_dir``), if any."""
    if not state.global_step or not args.output_dir:
        return None
    found = get_last_checkpoint(str(args.output_dir))  # type: ignore[no-untyped-call]
    return str(found) if found else None


class StragglerDetectionCallback(TrainerCallback):
    """Straggler reports for the Trainer (see the module's description)."""

    def __init__(
        self,
        report_time_interval: float = 300.0,
        calc_relative_gpu_perf: bool = True,
        calc_individual_gpu_perf: bool = True,
        num_gpu_perf_scores_to_print: int = 5,
        gpu_relative_perf_threshold: float = 0.7,
        gpu_individual_perf_threshold: float = 0.7,
        stop_if_detected: bool = False,
        profiling_interval: int = 1,
        logger_name: str = "steadfast.straggler",
    ) -> None:
        self.timer = StepTimer(
            NVRxStragglerDetectionConfig(
                enabled=True,
                report_time_interval=report_time_interval,
                calc_relative_gpu_perf=calc_relative_gpu_perf,
                calc_individual_gpu_perf=calc_individual_gpu_perf,
                num_gpu_perf_scores_to_print=num_gpu_perf_scores_to_print,
                gpu_relative_perf_threshold=gpu_relative_perf_threshold,
                gpu_individual_perf_threshold=gpu_individual_perf_threshold,
                stop_if_detected=stop_if_detected,
                profiling_interval=profiling_interval,
                logger_name=logger_name,
            )
        )
        self._stopping = False

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.timer.begin()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.timer.end(int(state.global_step)):
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._stopping:
            raise SystemExit(EXIT_STRAGGLERS)
