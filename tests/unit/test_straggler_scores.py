"""Straggler score math against hand-computed values, and the printed report."""

from __future__ import annotations

import pytest

from steadfast import ConfigError
from steadfast.straggler import (
    Detector,
    NVRxStragglerDetectionConfig,
    Report,
    StragglerId,
    individual_scores,
    relative_scores,
)


def test_relative_scores():
    # medians 10, 12.5, 20 ms: the fastest is the reference
    assert relative_scores({0: 0.010, 1: 0.0125, 2: 0.020}) == pytest.approx(
        {0: 1.0, 1: 0.8, 2: 0.5}
    )
    assert relative_scores({0: 0.0, 1: float("nan")}) == {}


def test_individual_scores_track_each_ranks_best():
    scores, best = individual_scores({0: 0.010, 1: 0.020}, {})
    assert scores == {0: 1.0, 1: 1.0} and best == {0: 0.010, 1: 0.020}
    scores, best = individual_scores({0: 0.015, 1: 0.016}, best)  # 0 slowed, 1 got faster
    assert scores == pytest.approx({0: 0.010 / 0.015, 1: 1.0})
    assert best == {0: 0.010, 1: 0.016}


def test_identify_stragglers_and_format():
    report = Report(
        gpu_relative_perf_scores={0: 1.0, 1: 0.66, 2: 0.9},
        gpu_individual_perf_scores={0: 0.5, 1: 1.0, 2: 1.0},
        section_relative_perf_scores={"step": {0: 1.0, 1: 0.6}},
        rank_to_node={0: "n0", 1: "n1", 2: "n1"},
    )
    found = report.identify_stragglers()
    assert found["straggler_gpus_relative"] == {StragglerId(1, "n1")}
    assert found["straggler_gpus_individual"] == {StragglerId(0, "n0")}
    assert found["straggler_sections_relative"] == {"step": {StragglerId(1, "n1")}}
    assert found["straggler_sections_individual"] == {}
    healthy = Report(
        gpu_relative_perf_scores={0: 1.0, 1: 0.74},  # NVRx's default threshold is 0.75
        gpu_individual_perf_scores={0: 1.0, 1: 1.0},
        section_relative_perf_scores={"section00": {0: 1.0, 1: 1.0}},
        section_individual_perf_scores={"section00": {0: 1.0, 1: 1.0}},
    )
    assert healthy.identify_stragglers()["straggler_gpus_relative"] == {StragglerId(1, "?")}
    nothing = healthy.identify_stragglers(gpu_rel_threshold=0.7)
    # nothing straggles: every value is empty, so `if found[...]` sees no straggler
    assert not any(nothing.values()), nothing
    text = report.format_scores("GPU relative performance", report.gpu_relative_perf_scores, 2)
    assert text.splitlines() == [
        "GPU relative performance:",
        " Worst performing 2/3 ranks:",
        "  Rank=1 Node=n1 Score=0.66",
        "  Rank=2 Node=n1 Score=0.90",
        " Best performing 2/3 ranks:",
        "  Rank=0 Node=n0 Score=1.00",
        "  Rank=2 Node=n1 Score=0.90",
    ]


def test_single_process_detector_reports_on_its_schedule():
    det = Detector(report_time_interval=1e-9)
    step = det.wrap_callable(lambda: sum(range(1000)), "step")
    reports = []
    for _ in range(15):
        step()
        report = det.generate_report_if_interval_elapsed()
        if report is not None:
            reports.append(report)
    assert len(reports) == 6  # the first after 10 calls, then every call (tiny interval)
    assert reports[0].gpu_relative_perf_scores == {0: 1.0}
    assert set(reports[0].section_individual_perf_scores) == {"step"}


def test_config_defaults_and_validation():
    cfg = NVRxStragglerDetectionConfig()
    assert (cfg.enabled, cfg.report_time_interval, cfg.num_gpu_perf_scores_to_print) == (
        False, 300.0, 5)  # fmt: skip
    assert cfg.gpu_relative_perf_threshold == cfg.gpu_individual_perf_threshold == 0.7
    assert cfg.logger_name == "megatron.bridge.NVRxStragglerDetection"
    with pytest.raises(ConfigError, match="gpu_relative_perf_threshold"):
        NVRxStragglerDetectionConfig(gpu_relative_perf_threshold=1.5)
    with pytest.raises(ConfigError, match="profiling_interval"):
        NVRxStragglerDetectionConfig(profiling_interval=0)


def test_manager_prints_the_seeds_report_and_warnings(caplog: pytest.LogCaptureFixture):
    from steadfast.straggler import StragglerDetectionManager

    manager = StragglerDetectionManager(
        NVRxStragglerDetectionConfig(enabled=True, stop_if_detected=True)
    )
    report = Report(
        gpu_relative_perf_scores={0: 1.0, 1: 0.6},
        gpu_individual_perf_scores={0: 1.0, 1: 0.65},
        rank_to_node={0: "n0", 1: "n1"},
        generate_report_elapsed_time=0.042,
    )
    with caplog.at_level("INFO", logger="megatron.bridge.NVRxStragglerDetection"):
        assert manager._act(report, step=7) is True  # stop_if_detected
    text = caplog.text
    assert (
        "GPU relative performance:\n Worst performing 2/2 ranks:\n  Rank=1 Node=n1 Score=0.60"
        in text
    )
    assert "GPU individual performance:" in text
    assert "Straggler report processing time: 0.042 sec." in text
    assert (
        "STRAGGLER DETECTION WARNING: Some GPUs have worse relative performance. "
        "Affected ranks: [1]"
    ) in text
    assert "STRAGGLER DETECTION WARNING: Some GPUs performance dropped. Affected ranks: [1]" in text
