"""The GPU tests' one-rank process group. Skipped without a CUDA device."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A one-rank process group over gloo (CPU) and NCCL (CUDA), as a GPU job has."""
    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    store = tempfile.mktemp(prefix="sf-gpu-store-")
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", init_method=f"file://{store}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()
    if os.path.exists(store):
        os.unlink(store)
