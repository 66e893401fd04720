"""steadfast: keeps distributed PyTorch training alive and honest through faults.

The public names are re-exported here with the seeds' names (KempnerForge, NVIDIA
Resiliency Extension, Megatron Bridge), so a user of the originals can switch imports
without rewriting the training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import events

if TYPE_CHECKING:
    from .checkpoint import (
        CheckpointError,
        CheckpointFenced,
        CheckpointManager,
        DataPosition,
        ResumableSampler,
        RNGState,
        Stateful,
        resolve_resume_path,
    )
    from .config import ConfigError, FaultToleranceConfig
    from .dist import agree_any, backend_device, world_info
    from .faults import FaultKind, SlowFault, fail_at, setup_simulated_fault
    from .health import check_gpu_health, check_nccl_health
    from .nan_detector import NaNDetector, NaNState
    from .signals import (
        PREEMPTION_EXIT_CODE,
        DistributedSignalHandler,
        PreemptionConfig,
        PreemptionHandler,
        ShutdownHandler,
        sbatch_signal_option,
    )
    from .slurm import SLURMInfo, get_slurm_info, is_slurm_job, is_slurm_requeue, log_job_info


__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointFenced",
    "CheckpointManager",
    "ConfigError",
    "DataPosition",
    "FaultToleranceConfig",
    "RNGState",
    "ResumableSampler",
    "SlowFault",
    "FaultKind",
    "fail_at",
    "Stateful",
    "DistributedSignalHandler",
    "NaNDetector",
    "NaNState",
    "PREEMPTION_EXIT_CODE",
    "SLURMInfo",
    "PreemptionConfig",
    "PreemptionHandler",
    "ShutdownHandler",
    "__version__",
    "agree_any",
    "backend_device",
    "check_gpu_health",
    "check_nccl_health",
    "events",
    "get_slurm_info",
    "is_slurm_job",
    "is_slurm_requeue",
    "log_job_info",
    "resolve_resume_path",
    "sbatch_signal_option",
    "setup_simulated_fault",
    "world_info",
]

# The public names are imported on first use (PEP 562), so that `import steadfast.slurm`,
# `steadfast report` and `steadfast requeue` do not pay `import torch` (~2-3 s), and the
# launcher can start its worker template before it imports torch itself.
_LAZY: dict[str, str] = {
    "CheckpointError": ".checkpoint",
    "CheckpointFenced": ".checkpoint",
    "CheckpointManager": ".checkpoint",
    "DataPosition": ".checkpoint",
    "ResumableSampler": ".checkpoint",
    "RNGState": ".checkpoint",
    "Stateful": ".checkpoint",
    "resolve_resume_path": ".checkpoint",
    "ConfigError": ".config",
    "FaultToleranceConfig": ".config",
    "agree_any": ".dist",
    "backend_device": ".dist",
    "world_info": ".dist",
    "SlowFault": ".faults",
    "FaultKind": ".faults",
    "fail_at": ".faults",
    "setup_simulated_fault": ".faults",
    "NaNDetector": ".nan_detector",
    "NaNState": ".nan_detector",
    "check_gpu_health": ".health",
    "check_nccl_health": ".health",
    "PREEMPTION_EXIT_CODE": ".signals",
    "DistributedSignalHandler": ".signals",
    "PreemptionConfig": ".signals",
    "PreemptionHandler": ".signals",
    "ShutdownHandler": ".signals",
    "sbatch_signal_option": ".signals",
    "SLURMInfo": ".slurm",
    "get_slurm_info": ".slurm",
    "is_slurm_job": ".slurm",
    "is_slurm_requeue": ".slurm",
    "log_job_info": ".slurm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'steadfast' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next access does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
