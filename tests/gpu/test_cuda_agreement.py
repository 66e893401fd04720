"""The NaN check on a CUDA loss with NCCL (its all-reduce runs where the loss is, one host
sync after it) and the agreed shutdown riding on it. Skipped without a CUDA device (CI
has none); run where one is lent:

    python -m pytest tests/gpu -q
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_cuda_nan_is_agreed_and_carries_the_shutdown(group: None) -> None:
    from steadfast import NaNDetector, ShutdownHandler

    h = ShutdownHandler(timeout_sec=60, agree=True)
    h.register()
    d = NaNDetector(action="skip")
    try:
        assert h.should_shutdown(0) is False  # boards its rider; counts on gloo once
        assert d.check_loss(torch.tensor(float("nan"), device="cuda"), 1) is False
        assert h.should_shutdown(1) is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert d.check_loss(torch.tensor(2.5, device="cuda"), 2) is True
        assert d.state.last_good_loss == 2.5
        assert h._pending is None  # the NaN check's NCCL all-reduce carried the flag
        assert h.should_shutdown(2) is True
    finally:
        h.finish()
