"""The re-run state machine's vocabulary (Megatron-LM / Megatron Bridge names): its
modes, attributions and error injection types, its exit codes, and
:class:`RerunStateMachineConfig`, which checks them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..config import require_choice, require_number

__all__ = [
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "HARDWARE_ID_ENV",
    "INJECTION_TYPES",
    "MODES",
    "RerunDiagnostic",
    "RerunErrorInjector",
    "RerunMode",
    "RerunStateMachineConfig",
]

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
#: Overrides this process's hardware identity (node name + device) for attribution;
#: tests set it to fake a restart "on other hardware".
HARDWARE_ID_ENV = "STEADFAST_RERUN_HARDWARE_ID"

MODES = ("disabled", "validate_results", "report_stats")
#: Megatron-LM's name for report_stats (Megatron Bridge's config keeps report_stats)
_MODE_ALIASES = {"report_determinism_stats": "report_stats"}
INJECTION_TYPES = ("transient_error", "persistent_error", "correct_result")


class RerunMode(str, Enum):
    """Megatron-LM's operating modes (a ``str``: ``RerunMode.VALIDATE_RESULTS ==
    "validate_results"``); ``report_determinism_stats`` is ``report_stats``."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunDiagnostic(str, Enum):
    """Megatron-LM's attributions, also the error injection types."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


def _mode(value: Any) -> str:
    """A mode name from a string or a :class:`RerunMode`, as the config stores it."""
    text = str(value.value if isinstance(value, Enum) else value)
    return _MODE_ALIASES.get(text, text)


@dataclass
class RerunErrorInjector:
    """Megatron-LM's error injector: on average one validated result in
    ``error_injection_rate`` is made to fail validation, reproducing as
    ``error_injection_type`` says (0: never)."""

    error_injection_rate: int = 0
    error_injection_type: RerunDiagnostic | str = RerunDiagnostic.TRANSIENT_ERROR


@dataclass
class RerunStateMachineConfig:
    """Megatron Bridge's ``RerunStateMachineConfig`` (same names and defaults), plus the
    spiky-loss factor and the tracker file."""

    rerun_mode: str = "disabled"
    check_for_nan_in_loss: bool = True
    check_for_spiky_loss: bool = False
    spiky_loss_factor: float = 10.0
    error_injection_rate: int = 0
    error_injection_type: str = "transient_error"
    result_rejected_tracker_filename: str | None = None

    def __post_init__(self) -> None:
        self.rerun_mode = _mode(self.rerun_mode)
        if isinstance(self.error_injection_type, Enum):
            self.error_injection_type = str(self.error_injection_type.value)
        require_choice("rerun_mode", self.rerun_mode, MODES)
        require_choice("error_injection_type", self.error_injection_type, INJECTION_TYPES)
        require_number("error_injection_rate", self.error_injection_rate, minimum=0, integer=True)
        require_number("spiky_loss_factor", self.spiky_loss_factor, exclusive_minimum=1)
