"""The launcher's Prometheus endpoint (steadfast.metrics): the figures folded from a real
event log as it grows, the series the standard client library exposes for them
(checked by Prometheus's own `promtool check metrics`), the HTTP endpoint and its
file_sd target file, and one launcher only serving the job-wide series."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from steadfast import events
from steadfast.metrics import Figures, JobCollector, LogFollower, MetricsServer

pytestmark = pytest.mark.timeout(120)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    return path


def _run(steps: int, first: int = 1) -> None:
    """What a run writes: a node's workers, ``steps`` steps of ranks 0 and 1."""
    for step in range(first, first + steps):
        for rank in (0, 1):
            events.emit("step_done", step=step, rank=rank, seconds=0.2)


def _scrape(collector: JobCollector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} in\n{text}")


def test_the_figures_follow_the_log_as_it_grows(log: Path) -> None:
    events.emit("workers_started", generation=1, restart_count=0, node_rank=0, nodes=1,
                world_size=2, ranks=[0, 1], pids=[1, 2])  # fmt: skip
    _run(5)
    figures = Figures(str(log))
    figures.refresh()
    assert figures.steps == 5 and figures.step_count == 5  # rank 0's, not both ranks'
    assert figures.nodes == {events.writer._writer.host: "training"}
    events.emit("rank_failed", cause="signal SIGKILL", rank=1, local_rank=1, exit_code=-9)
    events.emit("restart", cause="worker_failure", restart_count=1, reason="r",
                remaining_restarts=2)  # fmt: skip
    events.emit("node_lost", cause="silent", node="node7", how="h")
    events.emit("straggler_report", relative={"0": 1.0, "1": 0.6}, individual={}, seconds=0)
    _run(3, first=4)  # steps 4-6 again, then on
    figures.refresh()
    assert figures.steps == 8 and figures.faults["rank_failed"] == 1
    assert figures.faults["node_lost"] == 1 and figures.restarts == {"in_job": 1, "requeue": 0}
    assert figures.nodes["node7"] == "lost" and figures.stragglers == {0: 1.0, 1: 0.6}
    assert figures.goodput is not None and 0.0 <= figures.goodput <= 1.0


def test_a_line_being_written_waits_and_a_broken_one_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    follower = LogFollower(path)
    assert follower.read() == []  # no log yet
    whole = json.dumps({"time": 1.0, "kind": "restart", "cause": "x"})
    path.write_text(whole + "\nnot json\n" + whole[:10])
    found = follower.read()
    assert [e.kind for e in found] == ["restart"] and follower.skipped == 1
    with path.open("a") as f:
        f.write(whole[10:] + "\n")
    assert [e.kind for e in follower.read()] == ["restart"]
    path.write_text(whole + "\n")  # a new, shorter log under the same name
    assert [e.kind for e in follower.read()] == ["restart"]


def test_the_series_follow_prometheus_conventions_and_promtool_says_so(log: Path) -> None:
    _run(4)
    events.emit("rank_failed", cause="exit 1", rank=0, local_rank=0, exit_code=1)
    events.emit("job_requeued", cause="restarts_exhausted", slurm_job="7", excluded=[])
    collector = JobCollector(Figures(str(log)), lambda: True,
                             lambda: {"section:step": 12.5}, "node1")  # fmt: skip
    text = _scrape(collector)
    assert _value(text, "steadfast_steps_total") == 4
    assert _value(text, 'steadfast_faults_total{kind="rank_failed"}') == 1
    assert _value(text, 'steadfast_restarts_total{kind="requeue"}') == 1
    assert _value(text, 'steadfast_step_duration_seconds_bucket{le="0.25"}') == 4
    assert (
        _value(text, 'steadfast_learned_timeout_seconds{node="node1",timeout="section:step"}')
        == 12.5
    )
    assert 0.0 <= _value(text, "steadfast_goodput_ratio") <= 1.0
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert all(n.startswith("steadfast_") for n in names)
    for line in text.splitlines():  # no label without a bound
        assert "step=" not in line and "pid=" not in line and "fault_id=" not in line
    promtool = shutil.which("promtool")
    if promtool is None:
        if IN_CI:
            pytest.fail("promtool is not installed; CI must check the metrics with it")
        pytest.skip("promtool is not installed (`make test` installs prometheus)")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_only_the_lead_launcher_serves_the_job_wide_series(log: Path) -> None:
    _run(2)
    text = _scrape(JobCollector(Figures(str(log)), lambda: False, dict, "node2"))
    assert "steadfast_steps_total" not in text and "steadfast_goodput_ratio" not in text
    assert "steadfast_learned_timeout_seconds" in text  # its own node's


def test_the_endpoint_serves_and_its_target_file_comes_and_goes(log: Path, tmp_path: Path) -> None:
    _run(3)
    collector = JobCollector(Figures(str(log)), lambda: True, dict, "node1")
    server = MetricsServer(collector, 0, addr="127.0.0.1", sd_dir=str(tmp_path / "sd"),
                           labels={"steadfast_job": "j1"})  # fmt: skip
    try:
        assert server.port > 0 and server.sd_file is not None
        (group,) = json.loads(server.sd_file.read_text())
        assert group == {"targets": [f"127.0.0.1:{server.port}"], "labels": {"steadfast_job": "j1"}}
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert _value(body, "steadfast_steps_total") == 3
    finally:
        server.close()
    assert not server.sd_file.exists()


def test_the_watch_screen_reads_every_fault_kind_it_shows(log: Path) -> None:
    """Each fault kind the screen lists, with the fields its kind has (a kind without a
    node or a summary must not stop the view)."""
    from steadfast.watch import Screen

    events.emit("workers_started", generation=1, restart_count=0, node_rank=0, nodes=1,
                world_size=2, ranks=[0, 1], pids=[1, 2])  # fmt: skip
    _run(3)
    events.emit("rank_failed", cause="signal SIGKILL", rank=1, local_rank=1, exit_code=-9)
    events.emit("fault_culprit", what="rank failed", node="n1", culprit_rank=1, fault_id="f")
    screen = Screen(log)
    screen.refresh()
    assert "culprit agreed: n1 rank 1" in screen.faults[-1]
    events.emit("rank_hung", cause="section:step", rank=0, elapsed=2.0, timeout=1.0)
    events.emit("hang_confirmed", cause="no_progress", culprit=0, summary="rank 0 stopped")
    events.emit("node_lost", cause="silent", node="n2", how="no beat for 5 s")
    events.emit("node_unhealthy", cause="network", reason="eth0's link is down")
    events.emit("node_isolated", cause="partition", how="cut off")
    events.emit("nan_detected", rank=0)
    events.emit("straggler_report", relative={"0": 1.0, "1": 0.5}, individual={}, seconds=0)
    events.emit("launcher_end", exit_code=0, reason="ok", no_progress=0)
    screen.refresh()
    text = "\n".join(screen.lines())
    assert "2 ranks" in text and "steps 3" in text and "n2 on" in text
    assert "rank 1 0.50" in text and "a launcher ended: exit 0" in text
    assert len(screen.faults) == 5  # the last five


def test_the_replica_checks_and_a_verdict_reach_the_series_and_the_screen(log: Path) -> None:
    """Issue 69: the checks agreed (a launcher's count grows through a generation and starts
    again with the next: 5 + 2 = 7 here), the newest step proven clean, the verdict a fault
    of its kind."""
    from steadfast.watch import Screen

    for checks, step in ((3, 29), (5, 49), (2, 19)):
        events.emit("replicas_checked", checks=checks, last_agreed_step=step, replicas=2,
                    ranks=[0, 1], state_bytes=404, chunks=1, proven_step=None)  # fmt: skip
    events.emit("sdc_verdict", cause="odd_one_out", culprits=[1], hosts=["n1"], local_ranks=[1],
                replicas=3, last_agreed_step=19, first_bad_step=29, clean_step=20)  # fmt: skip
    text = _scrape(JobCollector(Figures(str(log)), lambda: True, dict, "node1"))
    assert "steadfast_replica_checks_total 7.0" in text
    assert "steadfast_replicas_proven_step 49.0" in text
    assert 'steadfast_faults_total{kind="sdc_verdict"} 1.0' in text
    screen = Screen(log)
    screen.refresh()
    shown = "\n".join(screen.lines())
    assert "replicas  7 checks agreed; newest step proven clean 49" in shown
    assert "sdc_verdict" in shown and "rank(s) [1] on n1: odd_one_out after step 19" in shown
