"""Straggler detection (seed 003): per-section timing, relative and individual
performance scores, reports, and stop-on-detection. See :mod:`.scores` for the formulas,
:mod:`.detector` for timing and reports, :mod:`.manager` for Megatron Bridge's config."""

from __future__ import annotations

from .detector import Detector, Report
from .manager import NVRxStragglerDetectionConfig, StragglerDetectionManager
from .scores import StragglerId, individual_scores, relative_scores

__all__ = [
    "Detector",
    "NVRxStragglerDetectionConfig",
    "Report",
    "StragglerDetectionManager",
    "StragglerId",
    "individual_scores",
    "relative_scores",
]
