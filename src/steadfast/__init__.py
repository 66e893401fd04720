"""steadfast: keeps distributed PyTorch training alive and honest through faults.

The public names are re-exported here with the seeds' names (KempnerForge, NVIDIA
Resiliency Extension, Megatron Bridge), so a user of the originals can switch imports
without rewriting the training loop.
"""

from __future__ import annotations

from . import events
from .checkpoint import (
    CheckpointError,
    CheckpointManager,
    DataPosition,
    ResumableSampler,
    RNGState,
    Stateful,
    resolve_resume_path,
)
from .config import ConfigError, FaultToleranceConfig
from .dist import agree_any, backend_device, world_info
from .faults import SlowFault, setup_simulated_fault
from .health import NaNDetector, NaNState, check_gpu_health, check_nccl_health
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
    "CheckpointManager",
    "ConfigError",
    "DataPosition",
    "FaultToleranceConfig",
    "RNGState",
    "ResumableSampler",
    "SlowFault",
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
