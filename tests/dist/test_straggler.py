"""Straggler detection on real 2-rank gloo runs: uniform ranks (a report every 0.25 s, and
one at every step), a rank slowed 2x reported at the scoring window's bound, and
stop_if_detected stopping both ranks after the same step with a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfharness import run_ranks
from steadfast.straggler.detector import FIRST_REPORT_CALLS, WINDOW_SAMPLES, WINDOW_SECONDS

STEP_SECONDS = 0.006
SLOW_FROM = 10  # the first report is made at call 10: every later sample is slow
EVERY_STEP = 1e-9  # a report_time_interval that makes a report at every step
UNIFORM_STEP = 0.02  # the uniform runs' step: well above a busy machine's wake-up lag


def _run(rank: int, world: int, workdir: Path, steps: int, slow: bool, stop: bool, ckpt: str,
         interval: float = 0.05, seconds: float = STEP_SECONDS, factor: float = 1.5,
         slow_from: int = SLOW_FROM):  # fmt: skip
    import time

    import torch
    import torch.distributed as dist

    from steadfast import CheckpointManager, SlowFault
    from steadfast.straggler import NVRxStragglerDetectionConfig, StragglerDetectionManager

    cfg = NVRxStragglerDetectionConfig(
        enabled=True, report_time_interval=interval, stop_if_detected=stop
    )
    manager = StragglerDetectionManager(cfg)
    fault = SlowFault(factor=factor, rank=1, start_step=slow_from if slow else 10**9)

    def train_step(step: int) -> None:
        with fault.step(step):  # the slow rank's step itself takes longer
            time.sleep(seconds)

    compute = manager.wrap_train_step(train_step)
    x = torch.ones(1)
    mgr = CheckpointManager(ckpt) if stop else None
    reports, stopped = [], None
    for step in range(steps):
        compute(step)
        dist.all_reduce(x)  # lockstep, outside the timed section
        if manager.check(step):
            mgr.save(step + 1, {"x": x})
            stopped = step
            break
        if manager.last_report is not None and (
            not reports or manager.last_report is not reports[-1][0]
        ):
            reports.append((manager.last_report, dict(manager.stragglers), step))
    if mgr is not None:
        mgr.close()
    return [
        (r.gpu_relative_perf_scores, r.gpu_individual_perf_scores, s, step)
        for r, s, step in reports
    ], stopped


@pytest.mark.parametrize("interval", [0.25, EVERY_STEP], ids=["every-0.25s", "every-step"])
def test_uniform_ranks_have_no_straggler(tmp_path: Path, event_log: Path, interval: float):
    # a report every 0.25 s scores the ~12 steps since the last one; a report at every
    # step the scoring window's floor, 0.25 s of steps here: either way a burst of
    # scheduler delay on this shared 2-core machine (which over 8 steps made a healthy
    # rank score 0.63 once) does not move a median. The steps are 20 ms, not 6: with
    # every core taken (three pytest workers of multi-process tests), a rank's wake-up
    # from its step's sleep lagged ~3.5 ms for the whole run, and the rank that does more
    # work between steps (rank 0 scores the reports) lags the most, so 6 ms steps scored
    # a healthy rank 0.63 relative and 0.66 individual: slower it was, by the scheduler's
    # hand, not the product's. A real step is tens to hundreds of milliseconds.
    results = run_ranks(_run, tmp_path, args=(220, False, False, "", interval, UNIFORM_STEP))
    reports, _ = results[0]
    assert len(reports) >= (200 if interval == EVERY_STEP else 4)
    for rel, ind, found, _ in reports:
        assert found == {"relative": [], "individual": []}, (rel, ind)
    assert [json.loads(x)["kind"] for x in event_log.read_text().splitlines()].count(
        "straggler_detected") == 0  # fmt: skip


#: A step long enough that the window's floor is its samples: 3 steps span 0.3 s, more
#: than WINDOW_SECONDS, so the window is WINDOW_SAMPLES steps.
WINDOW_STEP = 0.1
WINDOW_SLOW_FROM = FIRST_REPORT_CALLS + WINDOW_SAMPLES  # reports at every step by then


def test_a_rank_slowed_2x_is_reported_at_the_windows_bound(tmp_path: Path, event_log: Path):
    assert WINDOW_SAMPLES * WINDOW_STEP > WINDOW_SECONDS
    # a report at every step: the verdict is the first report whose window of 3 has a
    # majority of slow samples, the one at the end of the 2nd slow step; none before
    # (one slow sample is not a verdict), none later. Each report is started at its step
    # and finished (scored, acted on) at the next: the loop sees it one step later, its
    # event names the step it scored.
    bound = WINDOW_SLOW_FROM + 1
    steps = bound + 3
    results = run_ranks(
        _run, tmp_path,
        args=(steps, True, False, "", EVERY_STEP, WINDOW_STEP, 2.0, WINDOW_SLOW_FROM),
    )  # fmt: skip
    verdicts = []
    for reports, _ in results:  # every rank computes the same verdicts
        assert [step for *_, step in reports] == list(range(FIRST_REPORT_CALLS, steps))
        flagged = [(step, found, rel, ind) for rel, ind, found, step in reports
                   if found["relative"] or found["individual"]]  # fmt: skip
        step, found, rel, ind = flagged[0]
        assert step == bound + 1, flagged
        assert found == {"relative": [1], "individual": [1]}, (rel, ind)
        assert rel[0] == 1.0 and rel[1] < 0.7 and ind[1] < 0.7
        assert all(f[1] == found for f in flagged)  # then on every report while slow
        verdicts.append([f[0] for f in flagged])
    assert verdicts[0] == verdicts[1] == list(range(bound + 1, steps))
    events = [json.loads(x) for x in event_log.read_text().splitlines()]
    detected = [e for e in events if e["kind"] == "straggler_detected"]
    assert detected[0]["ranks"] == [1] and detected[0]["rank"] == 0
    assert [e["step"] for e in detected] == list(range(bound, steps - 1))
    (fault,) = [e for e in events if e["kind"] == "fault_injected"]
    assert fault["fault"] == "slow_rank" and fault["step"] == WINDOW_SLOW_FROM


def test_stop_if_detected_stops_every_rank_after_the_same_step(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    results = run_ranks(_run, tmp_path / "w", args=(200, True, True, str(ckpt)))
    stops = [stopped for _, stopped in results]
    assert stops[0] is not None and stops[0] == stops[1]
    assert (ckpt / "latest").resolve().name == f"step_{stops[0] + 1}"
