"""What the frameworks' straggler callbacks share: NVRx's ``StragglerDetectionCallback``
arguments turned into a :class:`~steadfast.straggler.StragglerDetectionManager`, one
timed ``train_step`` section per training step, and the verdict acted on the same way
on every rank."""

from __future__ import annotations

from typing import Any

from ..straggler.manager import NVRxStragglerDetectionConfig, StragglerDetectionManager

#: The exit status of a rank stopped for stragglers: "resume on other hardware" (the
#: re-run state machine's 16), which ``steadfast launch`` does not restart in place and
#: its Slurm script requeues; a restart on the same slow GPU would find it again.
EXIT_STRAGGLERS = 16


class StepTimer:
    """The detector, a ``train_step`` section opened and closed around each step, and
    the periodic check (a collective: every rank, the same step)."""

    def __init__(
        self,
        report_time_interval: float,
        calc_relative_gpu_perf: bool,
        calc_individual_gpu_perf: bool,
        num_gpu_perf_scores_to_print: int,
        gpu_relative_perf_threshold: float,
        gpu_individual_perf_threshold: float,
        stop_if_detected: bool,
        enable_logging: bool,
        profiling_interval: int,
        logger_name: str,
    ) -> None:
        if not (calc_relative_gpu_perf or calc_individual_gpu_perf):
            raise ValueError(
                "calc_relative_gpu_perf, calc_individual_gpu_perf: at least one must be True"
            )
        self.manager = StragglerDetectionManager(
            NVRxStragglerDetectionConfig(
                enabled=True,
                report_time_interval=report_time_interval,
                calc_relative_gpu_perf=calc_relative_gpu_perf,
                calc_individual_gpu_perf=calc_individual_gpu_perf,
                num_gpu_perf_scores_to_print=num_gpu_perf_scores_to_print,
                gpu_relative_perf_threshold=gpu_relative_perf_threshold,
                gpu_individual_perf_threshold=gpu_individual_perf_threshold,
                stop_if_detected=stop_if_detected,
                enable_logging=enable_logging,
                profiling_interval=profiling_interval,
                logger_name=logger_name,
            )
        )
        self._timing: Any = None

    def begin(self) -> None:
        """The step starts: time it as ``train_step``."""
        self._timing = self.manager.detector.detection_section("train_step")
        self._timing.__enter__()

    def end(self, step: int) -> bool:
        """The step ended: the report if one is due; True when every rank should stop."""
        timing, self._timing = self._timing, None
        if timing is not None:
            timing.__exit__(None, None, None)
        return self.manager.check(step)
