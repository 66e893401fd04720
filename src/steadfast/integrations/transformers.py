"""steadfast for the Hugging Face ``Trainer``: callbacks that give a ``trainer.train()``
run under ``steadfast launch`` what ``examples/train.py`` has by hand (``pip install
steadfast[transformers]``)::

    trainer = Trainer(model, args, train_dataset=data, callbacks=[
        FaultToleranceCallback(), GracefulShutdownCallback(), NaNCallback(),
        VerifiedCheckpointCallback()])
    trainer.train(resume_from_checkpoint=last_verified_checkpoint(args.output_dir))

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

:class:`StragglerDetectionCallback` (NVRx's Lightning callback's arguments): the
model's training forwards timed on every rank (hooks on the Trainer's model, inside its
DDP wrapper, where no collective makes a fast rank wait for a slow one, so the
*relative* scores single a slow rank out, as under Lightning; whole optimizer steps when
no forward can be seen, a compiled one), a report every ``report_time_interval``
seconds (``straggler_report`` / ``straggler_detected`` events), and with
``stop_if_detected`` the Trainer saves a checkpoint at that step and every rank exits
16 ("resume on other hardware": ``steadfast launch`` does not restart it in place, its
Slurm script requeues).

:class:`VerifiedCheckpointCallback` and :func:`last_verified_checkpoint`: the Trainer
has no checkpoint-writer plugin (unlike Lightning's ``CheckpointIO``): it writes
``checkpoint-N`` in place with several writers (``save_pretrained``, ``torch.save``, each
rank's RNG file) and no atomic publish, and ``get_last_checkpoint`` takes the highest
number whether or not its files are whole. So steadfast cannot write them through
:class:`~steadfast.CheckpointManager` (nor in the background); it seals them instead:
once every rank's files of a save are written, rank 0 fsyncs them and writes the
manager's manifest (sizes, CRC-32) last (:func:`steadfast.checkpoint.write_manifest`),
and :func:`last_verified_checkpoint` resumes from the newest checkpoint that verifies,
skipping one the job died writing (no manifest) and one damaged since
(``checkpoint_corrupt``). The shutdown and straggler callbacks seal the checkpoint they
stop at before exiting.

Outside ``steadfast launch`` the monitoring is off and the events are still written.
Only the Trainer's public callback interface is used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import events
from ..checkpoint.manager import MANIFEST, CheckpointError, verify, write_manifest
from ..dist import barrier, broadcast_object, is_distributed, world_info
from ..straggler.manager import NVRxStragglerDetectionConfig
from ._common import (
    EXIT_STRAGGLERS,
    FT_STATE_FILE,
    Monitoring,
    NaNGuard,
    NaNRollback,
    StepTimer,
    checkpointing,
)

__all__ = [
    "FaultToleranceCallback",
    "GracefulShutdownCallback",
    "NaNCallback",
    "NaNRollback",
    "StragglerDetectionCallback",
    "VerifiedCheckpointCallback",
    "last_verified_checkpoint",
]

logger = logging.getLogger(__name__)
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


#: in ``output_dir``: from which step on every checkpoint is sealed (so an unsealed
#: newer one was cut short, and an unsealed older one predates the callback)
SEALED_SINCE = "_steadfast_sealed.json"
_sealing = False  # a VerifiedCheckpointCallback runs in this process


class VerifiedCheckpointCallback(TrainerCallback):
    """Seal every checkpoint the Trainer writes with a manifest (see the module's
    description), so that :func:`last_verified_checkpoint` can tell a whole checkpoint
    from one cut short or damaged. Costs one read of each checkpoint on rank 0 (the
    checksums; the files are fresh in the page cache) and a barrier, inside the
    ``checkpointing`` section when a FaultToleranceCallback monitors the rank."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Record, once, the step from which checkpoints are sealed."""
        global _sealing
        _sealing = True
        marker = Path(str(args.output_dir)) / SEALED_SINCE
        if state.is_world_process_zero and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            tmp = marker.with_name(f".{marker.name}.tmp")
            tmp.write_text(json.dumps({"since_step": int(state.global_step)}))
            os.replace(tmp, marker)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        _seal(args, state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        global _sealing
        _sealing = False


def _stop_after_a_save(control: TrainerControl) -> bool:
    """Ask the Trainer for a checkpoint at this step and for no further step (the
    callback exits in ``on_save``, once it is written); True, for the callback's flag."""
    control.should_save = True
    control.should_training_stop = True
    return True


def _seal(args: TrainingArguments, state: TrainerState) -> None:
    """After the Trainer saved ``checkpoint-N`` on every rank (``on_save``): wait for
    every rank's files (a barrier: each writes its RNG state), then rank 0 writes the
    manifest. Only while a VerifiedCheckpointCallback runs (the exits of the shutdown
    and straggler callbacks call it too, since they may come first in the list)."""
    if not _sealing:
        return
    with checkpointing():
        barrier()
        folder = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            write_manifest(folder, int(state.global_step), world_size=int(args.world_size))


def last_verified_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` that verifies against its manifest
    (for ``trainer.train(resume_from_checkpoint=...)``), or None when there is none yet.

    A checkpoint without a manifest newer than the step from which the run seals them
    (:class:`VerifiedCheckpointCallback` records it) was cut short (the job died while
    the Trainer wrote it) and is skipped, and so is one whose files no longer match
    its manifest (``checkpoint_corrupt``); one older than that step predates the
    callback and is taken unverified, with a warning, as is any checkpoint of a folder
    that was never sealed. If checkpoints are sealed but none is valid, raises
    :class:`~steadfast.CheckpointError` naming the problems rather than start over.

    Under ``torch.distributed`` (call it after creating the ``TrainingArguments``,
    which starts it) rank 0 decides and every rank gets its answer, or its error."""
    if not is_distributed():
        return _last_verified(Path(output_dir))
    answer: tuple[str, Any] | None = None
    if world_info().rank == 0:
        try:
            answer = ("ok", _last_verified(Path(output_dir)))
        except CheckpointError as exc:
            answer = ("error", str(exc))
    outcome, value = broadcast_object(answer, src=0)
    if outcome == "error":
        raise CheckpointError(value)
    return value  # type: ignore[no-any-return]


def _last_verified(folder: Path) -> str | None:
    if not folder.is_dir():
        return None
    found = sorted(
        ((int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name))),
        reverse=True,
    )
    found = [(n, p) for n, p in found if p.is_dir()]
    if not found:
        return None
    since: int | None = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        since = int(json.loads((folder / SEALED_SINCE).read_text())["since_step"])
    problems: list[str] = []
    for step, path in found:
        if not (path / MANIFEST).exists():
            if since is None or step <= since:
                logger.warning("resuming from %s unverified: it was written unsealed", path)
                return str(path)
            logger.warning("%s has no manifest: the job stopped while it was written", path)
            continue
        bad = verify(path)
        if not bad:
            return str(path)
        problems.extend(bad)
        logger.error("checkpoint %s is corrupt: %s", path, "; ".join(bad))
        events.emit("checkpoint_corrupt", cause="verify", path=str(path), reason="; ".join(bad))
    if problems:
        raise CheckpointError(f"no valid checkpoint in {folder}: " + "; ".join(problems))
    return None


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
            self._stopping = _stop_after_a_save(control)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """The checkpoint is written: seal it, leave now, exit 0, for the requeued job."""
        if self._stopping:
            _seal(args, state)
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
    """The checkpoint the Trainer resumed from, if any: at ``on_train_begin`` its state
    is the checkpoint's, so the step names it."""
    if not state.global_step or not args.output_dir:
        return None
    found = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    return str(found) if found.is_dir() else None


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

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if kw.get("model") is not None:  # the Trainer's own model, inside its DDP wrapper
            self.timer.time_forwards(kw["model"])

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.timer.close()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.timer.begin()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.timer.end(int(state.global_step)):
            self._stopping = _stop_after_a_save(control)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._stopping:
            _seal(args, state)
            raise SystemExit(EXIT_STRAGGLERS)
