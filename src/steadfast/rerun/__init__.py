"""The re-run state machine for result attribution (seed 003); see :mod:`.machine`."""

from __future__ import annotations

from .machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    HARDWARE_ID_ENV,
    RerunDataIterator,
    RerunState,
    RerunStateMachine,
    RerunStateMachineConfig,
    relative_difference,
)

__all__ = [
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "HARDWARE_ID_ENV",
    "RerunDataIterator",
    "RerunState",
    "RerunStateMachine",
    "RerunStateMachineConfig",
    "relative_difference",
]
