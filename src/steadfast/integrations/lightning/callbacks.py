"""The Lightning callbacks: each maps Lightning's hooks onto what every framework's
callbacks share (:mod:`steadfast.integrations._common`).

:class:`FaultToleranceCallback` (NVRx's ``ptl_resiliency`` name and arguments):

- **heartbeats and sections** through :class:`~steadfast.monitor.RankMonitorClient`:
  ``setup`` from the Trainer's setup to the first batch, ``step`` around each training
  batch (forward, backward, optimizer step), ``checkpointing`` around the strategy's
  checkpoint save (whoever asks for it: ``ModelCheckpoint``, a shutdown) and
  ``evaluation`` around validation, and a heartbeat per batch, so the launcher catches a
  rank hung in any of them by its section timeout;
- **calculated timeouts**: at the end of each training epoch and of ``fit`` (once enough
  steps were seen: ``skip_if_not_ready``), the ``step`` section's timeout from the steps
  seen on every rank, kept in ``exp_dir/_ft_state.json`` (NVRx's file name) and in the
  Lightning checkpoint, and loaded again by the next run;
- **simulated faults** with NVRx's ``simulated_fault_params`` (``fault_type``
  ``rank_killed`` / ``rank_hung`` / ``random``, ``base_delay``, ``rand_delay``,
  ``rank_to_fail``), through :func:`steadfast.setup_simulated_fault`;
- **events** for ``steadfast report``: ``job_start`` once the Trainer restored its state
  (with the checkpoint it resumed from) and ``step_done`` per training batch.

:class:`GracefulShutdownCallback`: SIGTERM or SIGUSR1 (a preemption notice, a time
limit, ``scancel --signal``) on any rank makes every rank stop after the same training
batch (:class:`~steadfast.ShutdownHandler` with ``agree=True``; the callback takes both
signals over from Lightning's own handlers for the run), save a checkpoint through the
Trainer where ``ModelCheckpoint`` keeps its last one, and exit 0, so that the requeued
job resumes there; a save that hangs is cut short by the forced exit after
``timeout_sec``. Lightning resumes mid-epoch exactly only with a resumable dataloader
(one with ``state_dict``/``load_state_dict``); with a plain ``DataLoader`` it runs the
epoch's remaining steps on its first batches again (its own warning says so): wrap the
train loader in :func:`~steadfast.integrations.lightning.resumable` (a
:class:`~steadfast.DataPosition` that Lightning keeps in its checkpoint) and a stop
after any batch resumes at the next one.

:class:`NaNCallback`: NaN/Inf gradients checked before each optimizer step on every
rank at once (:class:`~steadfast.NaNDetector`, one fused check and one all-reduce):
``skip`` drops the gradients so the step is a no-op, ``raise`` stops; after
``max_consecutive`` bad steps in a row the rank raises
:class:`~steadfast.integrations.lightning.NaNRollback`, and the launcher's in-job
restart rolls every rank back to the latest checkpoint.

:class:`StragglerDetectionCallback` (NVRx's name and arguments): the strategy's
``training_step`` (the forward, where no collective makes a fast rank wait for a slow
one) timed on every rank, a report every ``report_time_interval`` seconds (relative and
individual performance scores, printed and logged as ``straggler_report`` /
``straggler_detected`` events), and with ``stop_if_detected`` every rank saves
``last.ckpt`` and exits 16 ("resume on other hardware": ``steadfast launch`` does not
restart it in place, its Slurm script requeues it; NVRx exits 1).

Outside ``steadfast launch`` (no heartbeat table) the monitoring is off and the events
are still written. The callbacks never import anything from Lightning's internals.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from ... import events
from ...faults import FAULT_TYPES
from ...straggler.manager import NVRxStragglerDetectionConfig
from .._common import (
    EXIT_STRAGGLERS,
    FT_STATE_FILE,
    Monitoring,
    NaNGuard,
    StepTimer,
    checkpointing,
)

__all__ = [
    "FaultToleranceCallback",
    "GracefulShutdownCallback",
    "NaNCallback",
    "StragglerDetectionCallback",
]


class FaultToleranceCallback(Callback):
    """Heartbeats, sections, calculated timeouts and the run's events for a Lightning
    ``fit`` (see the module's description).

    ``calculate_timeouts``: set the ``step`` section's timeout from the steps seen
    (NVRx's ``safety_factor`` x the longest, across ranks). ``exp_dir``: where
    ``ft_state.json`` is kept (default: the Trainer's ``default_root_dir``).
    ``autoresume`` is NVRx's and taken: it has nothing to do here (``steadfast
    launch`` restarts in the job and its Slurm script requeues). ``simulated_fault_params``
    (a dict or an object with NVRx's fields) arms one simulated fault when ``fit`` starts.
    """

    def __init__(
        self,
        autoresume: bool = False,
        calculate_timeouts: bool = True,
        simulated_fault_params: Any = None,
        exp_dir: str | os.PathLike[str] | None = None,
        logger_name: str | None = None,
    ) -> None:
        self.simulated_fault_params = _fault_params(simulated_fault_params)
        self.autoresume = autoresume
        self.exp_dir = Path(exp_dir) if exp_dir is not None else None
        self.logger_name = logger_name
        self.monitoring = Monitoring(calculate_timeouts)
        self._state: dict[str, Any] | None = None  # from a checkpoint, until setup
        self._save: Any = None  # the strategy's own save_checkpoint, while wrapped

    # ------------------------------------------------------------------ helpers
    @property
    def state_key(self) -> str:
        return "steadfast_ft"

    def _state_file(self, trainer: Trainer) -> Path:
        return (self.exp_dir or Path(trainer.default_root_dir)) / FT_STATE_FILE

    # ------------------------------------------------------------------ the hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Start monitoring (under ``steadfast launch``) with the timeouts an earlier
        run calculated, and open the ``setup`` section."""
        if stage != "fit":
            return
        monitoring = self.monitoring
        monitoring.start(self._state_file(trainer))
        strategy = trainer.strategy
        if self._save is None:  # every save, whoever asks for it, in "checkpointing"
            self._save = strategy.save_checkpoint

            def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                monitoring.close("step")
                monitoring.open("checkpointing")
                try:
                    return self._save(*args, **kwargs)
                finally:
                    monitoring.close("checkpointing")

            strategy.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        if self.simulated_fault_params is not None:
            from ...faults import setup_simulated_fault

            setup_simulated_fault(simulate_fault=True, **self.simulated_fault_params)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The Trainer restored its state: ``job_start`` with where it resumed from."""
        client = self.monitoring.client
        if client is not None and self._state is not None:
            client.load_state_dict(self._state)
        events.job_start(int(trainer.global_step), int(trainer.world_size), _resumed_from(trainer))

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.monitoring.step_begin()

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        fields: dict[str, Any] = {}
        if loss is not None and hasattr(loss, "item"):
            fields["loss"] = float(loss.detach().item())
        self.monitoring.step_end(int(trainer.global_step) - 1, **fields)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.monitoring.open("evaluation")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.monitoring.close("evaluation")

    def state_dict(self) -> dict[str, Any]:
        client = self.monitoring.client
        return client.state_dict() if client is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict) or None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.monitoring.calculate(self._state_file(trainer), trainer.is_global_zero)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.monitoring.calculate(self._state_file(trainer), trainer.is_global_zero)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Stop monitoring (the rank leaves its row closed: not a hang) and give the
        strategy its own save back."""
        if stage != "fit":
            return
        if self._save is not None:
            trainer.strategy.save_checkpoint = self._save  # type: ignore[method-assign]
            self._save = None
        self.monitoring.stop()


def _fault_params(params: Any) -> dict[str, Any] | None:
    """NVRx's ``SimulatedFaultParams`` (or its dict) as setup_simulated_fault's
    arguments."""
    if params is None:
        return None
    get = params.get if isinstance(params, dict) else lambda k, d=None: getattr(params, k, d)
    fault_type = get("fault_type")
    if fault_type not in FAULT_TYPES:
        raise ValueError(
            f"simulated_fault_params.fault_type: {fault_type!r} (expected one of "
            f"{', '.join(FAULT_TYPES)})"
        )
    return {
        "simulated_fault_type": fault_type,
        "simulated_fault_base_delay": float(get("base_delay", 0.0)),
        "extra_delay_max": float(get("rand_delay", 0.0) or 0.0),
        "simulated_fault_rank": get("rank_to_fail"),
    }


def _resumed_from(trainer: Trainer) -> str | None:
    """The checkpoint the run resumed from: the one SteadfastCheckpointIO read (after any
    fall-back), else the one the Trainer was given."""
    path = getattr(trainer, "ckpt_path", None)
    if not path:
        return None
    loaded = getattr(trainer.strategy.checkpoint_io, "loaded_path", None)
    return str(loaded or path)


class GracefulShutdownCallback(Callback):
    """Stop every rank after the same batch on SIGTERM/SIGUSR1, with a checkpoint (see
    the module's description). ``timeout_sec``: the forced exit if the save hangs."""

    def __init__(self, timeout_sec: float = 600.0) -> None:
        from ...signals import ShutdownHandler

        self.handler = ShutdownHandler(timeout_sec=timeout_sec, agree=True)
        self._registered = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Take SIGTERM and SIGUSR1 over from Lightning, which installs its own handlers
        after the callbacks' ``setup`` and ``on_fit_start``: Lightning's SIGTERM handler
        (2.6) broadcasts from inside the handler on the signalled rank alone, which
        deadlocks a DDP job, and raises out of the loop without a checkpoint."""
        if not self._registered:
            self.handler.register()
            self._registered = True

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """After every batch, on every rank (a collective): stop here if any rank was
        signalled, saving where the next run resumes."""
        if not self.handler.should_shutdown(int(trainer.global_step)):
            return
        _save_last(trainer)
        self.handler.finish()
        self._registered = False
        # not trainer.should_stop: that ends the epoch early, and the epoch-end
        # checkpoint it triggers would mark the epoch done (its last batches never run)
        raise SystemExit(0)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._registered:
            self.handler.unregister()
            self._registered = False


class NaNCallback(Callback):
    """NaN/Inf gradients checked before each optimizer step (see the module's
    description). ``action``: ``skip`` (the default), ``warn`` or ``raise``."""

    def __init__(self, action: str = "skip", max_consecutive: int = 5) -> None:
        self.guard = NaNGuard(action, max_consecutive)

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Any
    ) -> None:
        self.guard.check(pl_module, int(trainer.global_step))

    def state_dict(self) -> dict[str, Any]:
        return self.guard.detector.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.guard.detector.load_state_dict(state_dict)


def _last_checkpoint(trainer: Trainer) -> Path:
    """Where ``ModelCheckpoint`` keeps its last checkpoint (``ckpt_path="last"`` finds
    it), or ``default_root_dir/last.ckpt`` without one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            name = callback.CHECKPOINT_NAME_LAST or "last"
            return Path(callback.dirpath) / f"{name}{callback.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "last.ckpt"


class StragglerDetectionCallback(Callback):
    """NVRx's ``StragglerDetectionCallback`` (see the module's description); with
    ``enable_ptl_logging`` the scores' min/median/max are logged through the module."""

    def __init__(
        self,
        report_time_interval: float,
        calc_relative_gpu_perf: bool,
        calc_individual_gpu_perf: bool,
        num_gpu_perf_scores_to_print: int,
        gpu_relative_perf_threshold: float,
        gpu_individual_perf_threshold: float,
        stop_if_detected: bool,
        enable_ptl_logging: bool,
        profiling_interval: int = 1,
        logger_name: str | None = "nemo_logger.StragglerDetectionCallback",
    ) -> None:
        self.enable_ptl_logging = enable_ptl_logging
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
                logger_name=logger_name or "steadfast.straggler",
            )
        )

        self._step: Any = None  # the strategy's own training_step, while wrapped
        self._logged: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Time the strategy's ``training_step`` as the ``train_step`` section."""
        if stage == "fit" and self._step is None:
            strategy = trainer.strategy
            self._step = strategy.training_step
            strategy.training_step = self.timer.manager.wrap_train_step(self._step)  # type: ignore[method-assign]

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._step is not None:
            trainer.strategy.training_step = self._step  # type: ignore[method-assign]
            self._step = None

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        stop = self.timer.manager.check(int(trainer.global_step))
        report = self.timer.manager.last_report
        if self.enable_ptl_logging and report is not None and report is not self._logged:
            self._logged = report
            import statistics

            for name, scores in (
                ("gpu_relative_perf", report.gpu_relative_perf_scores),
                ("gpu_individual_perf", report.gpu_individual_perf_scores),
            ):
                if scores:
                    values = list(scores.values())
                    pl_module.log_dict(
                        {
                            f"{name}/min": min(values),
                            f"{name}/median": statistics.median(values),
                            f"{name}/max": max(values),
                        },
                        rank_zero_only=True,
                    )
        if stop:
            _save_last(trainer)
            raise SystemExit(EXIT_STRAGGLERS)


def _save_last(trainer: Trainer) -> None:
    """Before a callback exits the process: a checkpoint where ``ModelCheckpoint`` keeps
    its last one, durable even when the plugin writes in the background (the wait in
    the ``checkpointing`` section, so that it is not taken for a hang)."""
    trainer.save_checkpoint(_last_checkpoint(trainer))
    wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
    if callable(wait):
        with checkpointing():
            wait()
