"""The re-run state machine for result attribution (seed 003); see :mod:`.machine`."""

from __future__ import annotations

from .machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    HARDWARE_ID_ENV,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    RerunStateMachineConfig,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
    relative_difference,
)

__all__ = [
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "HARDWARE_ID_ENV",
    "RerunDataIterator",
    "RerunDiagnostic",
    "RerunErrorInjector",
    "RerunMode",
    "RerunState",
    "RerunStateMachine",
    "RerunStateMachineConfig",
    "destroy_rerun_state_machine",
    "get_rerun_state_machine",
    "initialize_rerun_state_machine",
    "relative_difference",
]
