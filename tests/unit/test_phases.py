"""The worker's half of a restart's phases (steadfast.progress.phases), in one process with
the probe as a worker has it: every phase of a start timed from the real torch calls a
script makes, the phases adding up to the time from the process start to the first
iteration's end, and every function put back as it was once the first iteration ends."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.utils.data as data

from sfharness import started_probe
from steadfast import seam
from steadfast.progress import layout, phases
from steadfast.progress.probe import Probe

PHASES = ("imports", "init_process_group", "checkpoint_load", "compile", "first_batch")


def originals() -> dict[str, object]:
    return {
        "import": builtins.__import__,
        "init": dist.init_process_group,
        "load": torch.load,
        "iter": data.DataLoader.__iter__,
        "next": seam.dataloader_iterator_type().__next__,
    }


def test_a_start_is_split_into_phases_that_add_up(tmp_path: Path):
    before = originals()
    with started_probe() as p:
        assert originals() != before  # timed until the first iteration
        sys.modules.pop("colorsys", None)
        import colorsys  # noqa: F401  (a module not yet imported: an import to time)

        store = f"file://{tmp_path}/store"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        dist.destroy_process_group()  # (a group alive while dynamo compiles keeps its socket)
        torch.save({"w": torch.ones(4)}, tmp_path / "ck.pt")
        state = torch.load(tmp_path / "ck.pt")
        model = torch.nn.Linear(4, 1)
        model.load_state_dict({"weight": state["w"].reshape(1, 4), "bias": torch.zeros(1)})
        compiled = torch.compile(model, backend="eager")  # dynamo traces: a compilation
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = data.DataLoader(data.TensorDataset(torch.randn(8, 4)), batch_size=4)
        for (batch,) in loader:
            compiled(batch).sum().backward()
            opt.step()
            opt.zero_grad()
        got = phases.read(p.slots)
        assert got is not None
        assert originals() == before  # everything back after the first iteration
        for name in PHASES:
            assert got[name] > 0, (name, got)
        parts = sum(got[name] for name in (*PHASES, "setup", "first_step"))
        whole = got["first_step_end"] - got["process_start"]
        assert parts == pytest.approx(whole, abs=1e-5), got
        assert got["process_start"] <= got["first_forward"] <= got["first_step_end"]
        # after the first iteration nothing is timed any more
        seconds = p.slots[layout.PH_LOAD]
        torch.load(tmp_path / "ck.pt")
        assert p.slots[layout.PH_LOAD] == seconds
    assert originals() == before


def test_a_span_inside_another_counts_once_for_the_outer_one(probe: Probe, tmp_path: Path):
    """A checkpoint load that imports a module is load time, not import time too."""
    torch.save({"w": torch.ones(2)}, tmp_path / "ck.pt")
    imports = probe.slots[layout.PH_IMPORTS]
    with phases.loading():
        sys.modules.pop("colorsys", None)
        import colorsys  # noqa: F401

        torch.load(tmp_path / "ck.pt")
    assert probe.slots[layout.PH_IMPORTS] == imports
    assert probe.slots[layout.PH_LOAD] > 0


def test_phases_are_not_read_before_the_first_iteration(probe: Probe):
    assert phases.read(probe.slots) is None
    model = torch.nn.Linear(2, 1)
    model(torch.randn(1, 2))  # an eval-free forward: no optimizer yet, counted as one
    assert phases.read(probe.slots) is not None


def test_a_process_forked_from_the_worker_writes_no_phase(probe: Probe, tmp_path: Path):
    """A DataLoader worker (a fork) loading files must not add to the rank's phases."""
    import os

    torch.save({"w": torch.ones(2)}, tmp_path / "ck.pt")
    before = probe.slots[layout.PH_LOAD]
    pid = os.fork()
    if pid == 0:  # the child: the probe's fork handler made it inactive
        try:
            torch.load(tmp_path / "ck.pt")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert probe.slots[layout.PH_LOAD] == before
