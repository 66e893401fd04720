"""The restart's wait for the previous workers' GPU memory (steadfast.launcher.nodes.trust)
through the driver's NVML, on a real GPU: a process that holds 256 MiB counts until it
exits, and one that holds on past the bound keeps the node out, naming the MiB. Skipped
without a CUDA device (CI has none); run where one is lent:

    python -m pytest tests/gpu -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from steadfast.launcher.nodes.trust import gpu_memory_freed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HOLD = (
    "import sys, time, torch\n"
    "x = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')\n"
    "print('held', flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


def _holder(seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(seconds)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_nvml_sees_a_workers_memory_until_it_exits() -> None:
    brief = _holder(2.0)
    try:
        freed = gpu_memory_freed([brief.pid], 60.0)
        assert freed.skipped is None and freed.failed is None and freed.figure == 0.0
        assert brief.poll() is not None  # it waited for the exit
    finally:
        brief.kill()
        brief.wait()
    stuck = _holder(60.0)
    try:
        late = gpu_memory_freed([stuck.pid], 1.0)
        assert late.failed is not None and late.figure is not None and late.figure >= 256
    finally:
        stuck.kill()
        stuck.wait()
