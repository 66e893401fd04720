"""NVRx ``straggler`` called as its users call it, on steadfast: the class-level
Detector (initialize, detection_section, wrap_callables, generate_report, shutdown) and
ReportGenerator over timing summaries, on real 2-rank gloo groups."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sfharness import run_ranks
from steadfast import straggler


def test_the_class_level_detector_needs_initialize() -> None:
    with (
        pytest.raises(RuntimeError, match="not initialized"),
        straggler.Detector.detection_section("section00"),
    ):
        pass


class Model:
    def forward(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def class_level(rank: int, world: int, workdir: Path) -> Any:
    straggler.Detector.initialize(gather_on_rank0=True, node_name=f"node{rank}")
    model = Model()
    original = model.forward
    straggler.Detector.wrap_callables(callable_ids=[straggler.CallableId(model, "forward")])
    try:
        for _ in range(5):
            model.forward(0.002 * (rank + 1))  # rank 1 twice as slow
            with straggler.Detector.detection_section("data"):
                time.sleep(0.001)
        report = straggler.Detector.generate_report()
    finally:
        straggler.Detector.shutdown()
    restored = model.forward == original
    if report is None:
        return None, restored
    return (
        report.gpu_relative_perf_scores,
        sorted(report.section_relative_perf_scores),
        report.rank_to_node,
        restored,
    )


def test_class_level_detector_gathers_on_rank_0(tmp_path: Path) -> None:
    zero, one = run_ranks(class_level, tmp_path, 2)
    assert one == (None, True)  # the other ranks get None, as NVRx's
    scores, sections, nodes, restored = zero
    assert restored and nodes == {0: "node0", 1: "node1"}
    assert sections == ["Model.forward", "data"]
    assert scores[0] == 1.0 and 0.3 < scores[1] < 0.8  # the slower rank


def generated(rank: int, world: int, workdir: Path, gather: bool) -> Any:
    gen = straggler.ReportGenerator(["relative_perf_scores"], gather_on_rank0=gather,
                                    node_name=f"n{rank}")  # fmt: skip
    times = [1.0, 1.0, 2.0]
    kernels = {
        "kernel0": straggler.summarize([(rank + 1) * t for t in times]),
        "ncclDevKernel_AllReduce": straggler.summarize([(world - rank) * 10 * t for t in times]),
    }
    report = gen.generate_report({}, kernels)
    return None if report is None else report.gpu_relative_perf_scores


def test_report_generator_scores_kernel_summaries(tmp_path: Path) -> None:
    zero, one = run_ranks(generated, tmp_path / "gather", 2, args=(True,))
    assert one is None and zero == pytest.approx({0: 1.0, 1: 0.5})  # nccl kernels left out
    zero, one = run_ranks(generated, tmp_path / "own", 2, args=(False,))
    assert zero == pytest.approx({0: 1.0}) and one == pytest.approx({1: 0.5})
