"""The whole path on a GPU: ``steadfast launch`` runs ``tests/e2e/ft_train.py --cuda``
(one rank on the GPU, NCCL for the model, DDP or FSDP2), the rank is SIGKILLed late in
step 6, the launcher restarts it, and the new process restores from the memory tier
(``/dev/shm``, verified, copied into its GPU tensors through pinned chunks) or from disk,
and ends bit for bit where the fault-free run ends. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import assert_bit_exact, launch_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TRAIN = Path(__file__).parents[1] / "e2e" / "ft_train.py"
STEPS = 10


def launch(workdir: Path, mode: str, *script_args: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(
        workdir, "--nproc-per-node=1", "--monitor-interval=0.1", "--max-restarts=2",
        str(TRAIN), "--cuda", "--ckpt", str(workdir / "ck"), "--out", str(workdir / "out.pt"),
        "--steps", str(STEPS), "--ckpt-every", "4",
        *(["--fsdp"] if mode == "fsdp" else []), *script_args,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory"])
def test_a_killed_gpu_rank_resumes_bit_exact(tmp_path: Path, mode: str, memory: bool) -> None:
    code, _ = launch(tmp_path / "reference", mode)
    assert code == 0
    reference = torch.load(tmp_path / "reference" / "out.pt")
    extra = ["--memory-every", "1"] if memory else []
    code, evs = launch(tmp_path, mode, "--kill-every", "6", "--fault-rank", "0", *extra)
    assert code == 0
    (failed,) = [e for e in evs if e["kind"] == "rank_failed"]
    assert failed["cause"] == "signal SIGKILL"
    (loaded,) = [e for e in evs if e["kind"] == "checkpoint_loaded"]
    assert (loaded["step"], loaded["tier"]) == ((6, "memory") if memory else (4, "disk"))
    assert_bit_exact(tmp_path / "out.pt", reference)
