"""Each launcher's Prometheus endpoint (``--metrics-port``), through the standard client
library (``prometheus_client``: its exposition format, its HTTP server, its checks of
names), and the ``file_sd`` target file a site's Prometheus discovers it by.

Prometheus's conventions: every name starts ``steadfast_``; base units (``_seconds``);
counters end ``_total``; goodput is a 0-1 ``_ratio``; a node's state is a state set (one
series per state, 1 for the one it is in); no label without a bound (``kind`` and
``phase`` from fixed sets, ``node`` and ``rank`` bounded by the job's size; never a
step, a pid or a fault id). The job-wide series come from one launcher only, the one
``lead()`` says (node rank 0 of the current round): every launcher serves its own
node's series (its learned timeouts), so a site scrapes them all and never sums a
job-wide figure twice.

The figures are read from the run's event log at scrape time (:mod:`.figures`):
nothing runs in the workers' processes for them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from .figures import FAULT_KINDS, NODE_STATES, STEP_BUCKETS, Figures

__all__ = ["JobCollector", "MetricsServer"]

logger = logging.getLogger(__name__)


class JobCollector(Collector):
    """The job's series, read from ``figures`` at each scrape."""

    def __init__(
        self,
        figures: Figures,
        lead: Callable[[], bool],
        learned: Callable[[], Mapping[str, float]],
        node: str,
        ledger: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """``ledger``: the node ledger's faults by node (None: the job keeps none)."""
        self.figures, self.lead, self.learned, self.node = figures, lead, learned, node
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        f = self.figures
        f.refresh()
        learned = GaugeMetricFamily(
            "steadfast_learned_timeout_seconds",
            "a hang timeout learned from the intervals the ranks reported (this node's)",
            labels=["node", "timeout"],
        )
        for name, seconds in sorted(self.learned().items()):
            learned.add_metric([self.node, name], seconds)
        yield learned
        if not self.lead():
            return
        yield CounterMetricFamily(
            "steadfast_steps", "training steps completed (the lowest rank's)", value=f.steps
        )
        buckets = [(f"{b:g}", c) for b, c in zip(STEP_BUCKETS, f.bucket_counts, strict=True)]
        yield HistogramMetricFamily(
            "steadfast_step_duration_seconds",
            "how long each step took (the lowest rank's)",
            buckets=[*buckets, ("+Inf", f.step_count)],
            sum_value=f.step_sum,
        )
        if f.goodput is not None:
            yield GaugeMetricFamily(
                "steadfast_goodput_ratio",
                "productive time over wall time so far (steadfast report's accounting)",
                value=f.goodput,
            )
        yield _labelled(CounterMetricFamily, "steadfast_faults", "faults detected, by kind",
                        "kind", [(k, f.faults[k]) for k in FAULT_KINDS])  # fmt: skip
        yield _labelled(CounterMetricFamily, "steadfast_restarts",
                        "restarts: in_job (the workers) and requeue (Slurm)", "kind",
                        list(f.restarts.items()))  # fmt: skip
        yield _labelled(CounterMetricFamily, "steadfast_restart_phase_seconds",
                        "seconds the restarts spent in each phase, summed (steadfast "
                        "report's phases)", "phase", sorted(f.restart_phases.items()))  # fmt: skip
        states = StateSetMetricFamily(
            "steadfast_node_state", "each node's state in the job", labels=["node"]
        )
        for host, state in sorted(f.nodes.items()):
            states.add_metric([host], {s: s == state for s in NODE_STATES})
        yield states
        yield CounterMetricFamily(
            "steadfast_replica_checks",
            "checks of the DDP replicas' state that agreed (steadfast.sdc), every node's",
            value=f.replica_checks,
        )
        if f.proven_step is not None:
            yield GaugeMetricFamily(
                "steadfast_replicas_proven_step",
                "the newest step at which every replica held the same state",
                value=f.proven_step,
            )
        scores = [(str(rank), score) for rank, score in sorted(f.stragglers.items())]
        yield _labelled(GaugeMetricFamily, "steadfast_straggler_score",
                        "each rank's latest relative performance score (1: as fast as the "
                        "best)", "rank", scores)  # fmt: skip
        if self.ledger is not None:
            counts = self.ledger()
            ledger = GaugeMetricFamily(
                "steadfast_node_ledger_faults",
                "faults the node ledger holds of each of the job's nodes in its window",
                labels=["node"],
            )
            for host in sorted(set(f.nodes) | {self.node}):
                ledger.add_metric([host], counts.get(host, 0))
            yield ledger


def _labelled(
    family: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: list[tuple[str, float]],
) -> Metric:
    """A counter or gauge family with one sample per ``(label value, value)``."""
    metric = family(name, doc, labels=[label])
    for key, value in values:
        metric.add_metric([key], value)
    return metric


class MetricsServer:
    """The endpoint on ``addr:port`` (0: a free port), serving ``collector``; with
    ``sd_dir``, a ``file_sd`` target file there naming it (removed at :meth:`close`)."""

    def __init__(
        self, collector: Collector, port: int, addr: str = "", sd_dir: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server, self._thread = start_http_server(port, addr=addr or "0.0.0.0",
                                                       registry=self.registry)  # fmt: skip
        self.port = int(self._server.server_port)
        self.target = f"{socket.getfqdn() if not addr or addr == '0.0.0.0' else addr}:{self.port}"
        self.sd_file: Path | None = None
        if sd_dir:
            self.sd_file = _write_target(Path(sd_dir), self.target, dict(labels or {}))
        logger.info("metrics: serving on %s%s", self.target,
                    f" (file_sd: {self.sd_file})" if self.sd_file else "")  # fmt: skip

    def close(self) -> None:
        """Stop serving, its thread joined, and remove the target file."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
        if self.sd_file is not None:
            with contextlib.suppress(OSError):
                self.sd_file.unlink()


def _write_target(folder: Path, target: str, labels: dict[str, Any]) -> Path:
    """``folder/steadfast-<host>-<pid>.json``: one file_sd target group, replaced whole
    (a temporary file renamed over it: Prometheus never reads half of it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"steadfast-{socket.gethostname()}-{os.getpid()}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as out:
        json.dump([{"targets": [target], "labels": labels}], out)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path
