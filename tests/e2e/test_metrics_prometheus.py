"""A real Prometheus scrapes a real run (issue 41): Debian's `prometheus` on a loopback
port with a data folder of its own finds the launcher's endpoint through the file_sd
target file the launcher writes, scrapes it every second while `examples/train.py`
trains with a rank killed mid-run, and is then asked for the series back: the steps
increase, the fault is counted, goodput is below 1 after it. A live scrape passes
`promtool check metrics`, and every query of the Grafana dashboard that ships in the
project (dashboards/steadfast-grafana.json) is accepted by Prometheus and names only
series the run exposed."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sfharness import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
DASHBOARD = ROOT / "dashboards" / "steadfast-grafana.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One Prometheus of this test's own: its config, data and log under ``root``."""

    def __init__(self, root: Path, sd_dir: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            if IN_CI:
                pytest.fail("prometheus is not installed; CI must run the scrape test")
            pytest.skip("prometheus is not installed (`make test` installs it)")
        config = root / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: steadfast\n    file_sd_configs:\n"
            f"      - files: ['{sd_dir}/*.json']\n        refresh_interval: 1s\n"
        )
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = root / "prometheus.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_for(self._ready, timeout=60, what="prometheus ready")
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def series(self, expr: str, start: float, end: float) -> list[float]:
        args = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 1})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{args}", timeout=10) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        results = answer["data"]["result"]
        assert len(results) == 1, results
        return [float(v) for _, v in results[0]["values"]]

    def names(self) -> set[str]:
        """Every metric name it scraped."""
        with urllib.request.urlopen(self.url + "/api/v1/label/__name__/values", timeout=10) as r:
            return set(json.load(r)["data"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_a_real_prometheus_scrapes_a_run_with_a_fault(tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    sd.mkdir()
    prom = Prometheus(tmp_path, sd)
    try:
        began = time.time()
        launch = subprocess.Popen(
            [sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
             "--nproc-per-node=2", "--max-restarts=3", "--events", str(tmp_path / "events.jsonl"),
             "--metrics-port=0", "--metrics-addr=127.0.0.1", f"--metrics-sd-dir={sd}",
             f"--ft-node-ledger={tmp_path / 'ledger'}",
             str(TRAIN), "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", "60",
             "--save-every", "5", "--step-sleep", "0.25", "--fault", "rank_killed:1:20"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        wait_for(lambda: any(sd.glob("*.json")), timeout=120, what="the file_sd target")
        (group,) = json.loads(next(sd.glob("*.json")).read_text())
        wait_for(lambda: bool(prom.query("steadfast_steps_total")), timeout=120,
                 what="a first scrape")  # fmt: skip
        with urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=10) as r:
            live = r.read().decode()
        out, _ = launch.communicate(timeout=240)
        assert launch.returncode == 0, out[-4000:]
        ended = time.time()
        assert not list(sd.glob("*.json"))  # the target file went with the launcher
        steps = prom.series("steadfast_steps_total", began, ended)
        assert steps == sorted(steps) and steps[-1] > steps[0], steps  # increasing
        faults = prom.query('max_over_time(steadfast_faults_total{kind="rank_failed"}[10m])')
        assert faults and float(faults[0]["value"][1]) >= 1, faults
        (goodput,) = prom.query("last_over_time(steadfast_goodput_ratio[10m])")
        assert 0.0 < float(goodput["value"][1]) < 1.0, goodput
        assert goodput["metric"]["steadfast_job"] == group["labels"]["steadfast_job"]
        _goodput_is_the_reports(prom, tmp_path / "events.jsonl", began, ended)
        promtool = shutil.which("promtool")
        assert promtool is not None
        checked = subprocess.run([promtool, "check", "metrics"], input=live, text=True,
                                 capture_output=True, timeout=60)  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
        exposed = prom.names()  # every series it scraped over the run
        for expr in _dashboard_queries():
            prom.query(expr)  # Prometheus parses and runs it
            named = set(re.findall(r"\bsteadfast_[a-z_]+", expr))
            assert named <= exposed, (expr, named - exposed)
    finally:
        prom.close()


def _goodput_is_the_reports(prom: Prometheus, log: Path, began: float, ended: float) -> None:
    """The goodput Prometheus holds at its last scrape is the report's accounting of the
    log as it was a moment before (the launcher computes it again at most every
    GOODPUT_EVERY seconds, and at once at a generation's turn): at some cut of the log in
    that window, ``steadfast report`` gives the same figure."""
    from steadfast.metrics.figures import GOODPUT_EVERY
    from steadfast.report import compute_report, load_events

    args = urllib.parse.urlencode({"query": "steadfast_goodput_ratio", "start": began,
                                   "end": ended, "step": 0.5})  # fmt: skip
    with urllib.request.urlopen(f"{prom.url}/api/v1/query_range?{args}", timeout=10) as r:
        (result,) = json.load(r)["data"]["result"]
    at, value = result["values"][-1]
    evs, _ = load_events(log)
    cuts = [
        float(at) - GOODPUT_EVERY - 2.0 + 0.05 * i
        for i in range(int((GOODPUT_EVERY + 2) / 0.05) + 1)
    ]
    figures = {round(compute_report([e for e in evs if e.time <= cut]).goodput, 4)
               for cut in cuts if any(e.time <= cut for e in evs)}  # fmt: skip
    closest = min(figures, key=lambda g: abs(g - float(value)))
    assert abs(closest - float(value)) < 1e-3, (value, sorted(figures))


def _dashboard_queries() -> list[str]:
    """Every query of the Grafana dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert queries
    return queries
