"""Megatron Bridge's straggler configuration and manager (seed 003).

``NVRxStragglerDetectionConfig`` has the same names and defaults.
``StragglerDetectionManager`` wraps the train step, makes the periodic report, prints it
on rank 0 in the seed's format, writes ``straggler_report`` / ``straggler_detected``
events, and with ``stop_if_detected`` returns the same "stop" on every rank at the same
step (the verdict is computed from the same gathered data on every rank), so the loop
can save a checkpoint and exit together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import events
from ..config import ConfigError, require_number
from ..dist import group_rank
from .detector import Detector, PendingReport
from .reporting import Report

__all__ = [
    "NVRxStragglerDetectionConfig",
    "NVRxStragglerDetectionManager",
    "StragglerDetectionManager",
    "check_nvrx_straggler_detection",
    "safe_shutdown_nvrx_straggler_manager",
]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class NVRxStragglerDetectionConfig:
    """Megatron Bridge's ``NVRxStragglerDetectionConfig`` (same names and defaults)."""

    enabled: bool = False
    report_time_interval: float = 300.0
    calc_relative_gpu_perf: bool = True
    calc_individual_gpu_perf: bool = True
    num_gpu_perf_scores_to_print: int = 5
    gpu_relative_perf_threshold: float = 0.7
    gpu_individual_perf_threshold: float = 0.7
    stop_if_detected: bool = False
    enable_logging: bool = True
    profiling_interval: int = 1
    logger_name: str = "megatron.bridge.NVRxStragglerDetection"

    def __post_init__(self) -> None:
        require_number("report_time_interval", self.report_time_interval, exclusive_minimum=0)
        require_number(
            "num_gpu_perf_scores_to_print",
            self.num_gpu_perf_scores_to_print,
            minimum=0,
            integer=True,
        )
        for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
            value = require_number(name, getattr(self, name), minimum=0)
            if value > 1:
                raise ConfigError(f"{name}: must be within [0, 1], got {value!r}")
        require_number("profiling_interval", self.profiling_interval, minimum=1, integer=True)


class StragglerDetectionManager:
    """Wraps the train step with the detector and acts on its reports.

    Call :meth:`check` once per step on every rank; it returns True (on every rank at
    once) when ``stop_if_detected`` is set and a report found stragglers.
    """

    def __init__(self, config: NVRxStragglerDetectionConfig, group: Any = None) -> None:
        self.config = config
        self.logger = logging.getLogger(config.logger_name)
        self.group = group
        self.detector = Detector(
            report_time_interval=config.report_time_interval,
            profiling_interval=config.profiling_interval,
            calc_relative=config.calc_relative_gpu_perf,
            calc_individual=config.calc_individual_gpu_perf,
            group=group,
        )
        self.last_report: Report | None = None
        self.stragglers: dict[str, list[int]] = {}
        self._pending: tuple[PendingReport, int | None] | None = None

    def wrap_train_step(self, fn: F) -> F:
        """``fn`` timed as the ``train_step`` section (when enabled)."""
        if not self.config.enabled:
            return fn
        wrapped: F = self.detector.wrap_callable(fn, "train_step")
        return wrapped

    def check(self, step: int | None = None) -> bool:
        """Call once per step on every rank; True (on every rank at once) when training
        should stop. A due report is started here and finished at the next call, so the
        step never waits for its collective: its verdict comes one step later, and its
        events name the step it scored."""
        if not self.config.enabled:
            return False
        stop = False
        if self._pending is not None:
            pending, scored = self._pending
            self._pending = None
            report = self.detector.finish_report(pending)
            if report is not None:
                stop = self._act(report, scored)
        if self.detector.report_due():
            self._pending = (self.detector.start_report(), step)
        return stop

    def close(self) -> None:
        """Wait for a report still gathering (every rank started it), unscored."""
        if self._pending is not None:
            self._pending[0].gather.read()
            self._pending = None

    def _act(self, report: Report, step: int | None) -> bool:
        cfg = self.config
        self.last_report = report
        found = report.identify_stragglers(
            gpu_rel_threshold=cfg.gpu_relative_perf_threshold,
            gpu_indiv_threshold=cfg.gpu_individual_perf_threshold,
            section_rel_threshold=cfg.gpu_relative_perf_threshold,
            section_indiv_threshold=cfg.gpu_individual_perf_threshold,
        )
        relative = sorted(s.rank for s in found["straggler_gpus_relative"])
        individual = sorted(s.rank for s in found["straggler_gpus_individual"])
        self.stragglers = {"relative": relative, "individual": individual}
        leader = group_rank(self.group) == 0
        if leader:
            self._print(report, relative, individual)
            if cfg.enable_logging:
                events.emit(
                    "straggler_report",
                    step=step,
                    relative=_round(report.gpu_relative_perf_scores),
                    individual=_round(report.gpu_individual_perf_scores),
                    seconds=round(report.generate_time, 6),
                )
            if relative or individual:
                events.emit(
                    "straggler_detected",
                    step=step,
                    cause="relative" if relative else "individual",
                    ranks=sorted(set(relative) | set(individual)),
                    relative=relative,
                    individual=individual,
                    scores=_round(report.gpu_relative_perf_scores),
                )
        return bool(cfg.stop_if_detected and (relative or individual))

    def _print(self, report: Report, relative: list[int], individual: list[int]) -> None:
        cfg, log = self.config, self.logger
        num = cfg.num_gpu_perf_scores_to_print
        if num > 0:
            blocks = []
            if cfg.calc_relative_gpu_perf:
                blocks.append(
                    report.format_scores(
                        "GPU relative performance", report.gpu_relative_perf_scores, num
                    )
                )
            if cfg.calc_individual_gpu_perf:
                blocks.append(
                    report.format_scores(
                        "GPU individual performance", report.gpu_individual_perf_scores, num
                    )
                )
            blocks.append(f" Straggler report processing time: {report.generate_time:.3f} sec.")
            log.info("\n%s", "\n\n".join(blocks))
        if relative:
            log.warning(
                "STRAGGLER DETECTION WARNING: Some GPUs have worse relative performance. "
                "Affected ranks: %s",
                relative,
            )
        if individual:
            log.warning(
                "STRAGGLER DETECTION WARNING: Some GPUs performance dropped. Affected ranks: %s",
                individual,
            )


def _round(scores: dict[int, float]) -> dict[str, float]:
    return {str(rank): round(score, 4) for rank, score in scores.items()}


class NVRxStragglerDetectionManager(StragglerDetectionManager):
    """Megatron Bridge's manager, with its names: ``initialize()``,
    ``wrap_train_step_function(fn)``, ``check_stragglers(global_rank)``, ``shutdown()``.

    Unlike Megatron Bridge's (whose ``wrap_train_step_function`` times a copy of the step
    and returns the original, untimed), the function returned is the timed one, as its
    documentation says. The verdict of ``check_stragglers`` is the same on every rank.
    """

    def __init__(self, config: NVRxStragglerDetectionConfig, group: Any = None) -> None:
        super().__init__(config, group)
        self.initialized = False
        self.wrapped_function: Callable[..., Any] | None = None

    def initialize(self) -> None:
        """Start detecting (nothing when disabled); twice is an error."""
        if self.initialized:
            raise RuntimeError("NVRxStragglerDetectionManager is already initialized.")
        if self.config.enabled:
            self.initialized = True

    def wrap_train_step_function(self, train_step_func: F) -> F:
        """The train step, timed as the ``train_step`` section (unchanged when not
        initialized or disabled, or when a step was wrapped already)."""
        if not (self.initialized and self.config.enabled):
            return train_step_func
        if self.wrapped_function is not None:
            self.logger.warning("Train step function already wrapped. Skipping.")
            return train_step_func
        self.wrapped_function = train_step_func
        return self.wrap_train_step(train_step_func)

    def check_stragglers(self, global_rank: int) -> bool:
        """Report if one is due; True when stragglers were found and
        ``stop_if_detected`` (collective: every rank calls it at the same step)."""
        if not (self.initialized and self.config.enabled):
            return False
        return self.check()

    def shutdown(self) -> None:
        """Stop detecting."""
        self.close()
        self.initialized = False
        self.wrapped_function = None


def check_nvrx_straggler_detection(
    nvrx_straggler_manager: NVRxStragglerDetectionManager | None,
) -> bool:
    """Megatron Bridge's helper: whether training should exit for stragglers (False
    without a manager)."""
    if nvrx_straggler_manager is None:
        return False
    return nvrx_straggler_manager.check_stragglers(group_rank())


def safe_shutdown_nvrx_straggler_manager(
    manager: NVRxStragglerDetectionManager | None, logger_name: str = "nvrx_straggler"
) -> None:
    """Megatron Bridge's helper: shut the manager down, logging (not raising) an error."""
    if manager is None:
        return
    try:
        manager.shutdown()
    except Exception as exc:
        logging.getLogger(logger_name).error(
            "Error shutting down NVRx straggler detection: %s", exc
        )
