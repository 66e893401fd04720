"""The re-run state machine for result attribution (seed 003): the machine in
:mod:`.machine`, its names and config in :mod:`.config`, the batches' replay in
:mod:`.data`."""

from __future__ import annotations

from .config import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    HARDWARE_ID_ENV,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunStateMachineConfig,
)
from .data import RerunDataIterator
from .machine import (
    RerunState,
    RerunStateMachine,
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
