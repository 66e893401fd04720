"""Straggler detection (seed 003): per-section timing, relative and individual
performance scores, reports, and stop-on-detection. See :mod:`.scores` for the formulas,
:mod:`.detector` for timing (and NVRx's class-level ``Detector.initialize`` use),
:mod:`.reporting` for reports and NVRx's ``ReportGenerator``, :mod:`.manager` for
Megatron Bridge's config."""

from __future__ import annotations

from . import reporting
from .detector import CallableId, Detector
from .manager import (
    NVRxStragglerDetectionConfig,
    NVRxStragglerDetectionManager,
    StragglerDetectionManager,
    check_nvrx_straggler_detection,
    safe_shutdown_nvrx_straggler_manager,
)
from .reporting import Report, ReportGenerator, Statistic, summarize
from .scores import StragglerId, individual_scores, relative_scores

__all__ = [
    "CallableId",
    "Detector",
    "NVRxStragglerDetectionConfig",
    "NVRxStragglerDetectionManager",
    "Report",
    "ReportGenerator",
    "Statistic",
    "StragglerDetectionManager",
    "StragglerId",
    "check_nvrx_straggler_detection",
    "individual_scores",
    "relative_scores",
    "reporting",
    "safe_shutdown_nvrx_straggler_manager",
    "summarize",
]
