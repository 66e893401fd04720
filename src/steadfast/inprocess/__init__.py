"""In-process restart (NVRx ``inprocess``): restart the training function on all healthy
ranks inside the same processes. See :class:`Wrapper`."""

from __future__ import annotations

from .compose import Compose
from .hooks import (
    Abort,
    AbortTorchDistributed,
    CudaHealthCheck,
    FaultCounter,
    Finalize,
    HealthCheck,
    Initialize,
    RetryController,
)
from .rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    MaxActiveWorldSize,
    RankAssignment,
    RankFilter,
    ShiftRanks,
)
from .state import (
    BarrierTimeout,
    HealthCheckError,
    InterruptedIteration,
    RestartAbort,
    RestartError,
    State,
)
from .store import StoreMixin, TCPStore
from .wrapper import CallWrapper, Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "BarrierTimeout",
    "CallWrapper",
    "Compose",
    "CudaHealthCheck",
    "FaultCounter",
    "FillGaps",
    "Finalize",
    "HealthCheck",
    "HealthCheckError",
    "Initialize",
    "InterruptedIteration",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankFilter",
    "RestartAbort",
    "RestartError",
    "RetryController",
    "ShiftRanks",
    "State",
    "StoreMixin",
    "TCPStore",
    "Wrapper",
]
