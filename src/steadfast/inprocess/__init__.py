"""In-process restart (NVRx ``inprocess``): restart the training function on all healthy
ranks inside the same processes. See :class:`Wrapper`; the nested restarter's hooks are
in :mod:`steadfast.inprocess.nested_restarter`."""

from __future__ import annotations

from .compose import Compose
from .hooks import (
    Abort,
    AbortTorchDistributed,
    Completion,
    CudaHealthCheck,
    FaultCounter,
    Finalize,
    HealthCheck,
    Initialize,
    RetryController,
    Terminate,
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
    "Completion",
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
    "Terminate",
    "Wrapper",
]
