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
    RankAssignmentCtx,
    RankDiscarded,
    RankFilter,
    ShiftRanks,
)
from .state import (
    BarrierTimeout,
    FrozenState,
    HealthCheckError,
    InterruptedIteration,
    Mode,
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
    "FrozenState",
    "HealthCheck",
    "HealthCheckError",
    "Initialize",
    "InterruptedIteration",
    "MaxActiveWorldSize",
    "Mode",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
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
