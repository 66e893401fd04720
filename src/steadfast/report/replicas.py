"""The replica checks in a run's report (steadfast.sdc): how often the replicas'
state was checked and found equal, the newest step proven clean, the compute audits
(each rank's last), and each verdict."""

from __future__ import annotations

from typing import Any

from .. import events as ev

__all__ = ["ReplicaTally", "replica_lines", "replica_summary"]


class ReplicaTally:
    """``replicas_checked`` folded as they come: the checks agreed, every node's and
    every generation's (a launcher counts again from 0 in each generation), the nodes
    and the newest step proven clean. The report folds a whole log; the metrics fold a
    growing one."""

    def __init__(self) -> None:
        self.last: dict[tuple[Any, Any], int] = {}  # a launcher's, in its generation
        self.before = 0  # of the generations that ended
        self.nodes: set[Any] = set()
        self.newest: int | None = None

    @property
    def checks(self) -> int:
        return self.before + sum(self.last.values())

    def add(self, e: ev.Event) -> None:
        key = (e.get("host"), e.get("pid"))
        checks = int(e.get("checks") or 0)
        if checks < self.last.get(key, 0):  # counted from 0 again: a new generation
            self.before += self.last[key]
        self.last[key] = checks
        self.nodes.add(e.get("host"))
        step = e.get("last_agreed_step")
        if isinstance(step, int) and (self.newest is None or step > self.newest):
            self.newest = step


def replica_summary(evs: list[ev.Event]) -> dict[str, Any] | None:
    """``checks`` (agreed, every node's, every generation's), ``nodes``,
    ``last_agreed_step``, ``verdicts`` (each ``sdc_verdict``'s fields) and the compute
    audits, or None for a run with no replica check."""
    tally = ReplicaTally()
    for e in evs:
        if e.kind == ev.Kind.REPLICAS_CHECKED:
            tally.add(e)
    verdicts = [dict(e.fields, cause=e.cause, time=e.time) for e in evs
                if e.kind == ev.Kind.SDC_VERDICT]  # fmt: skip
    audits = [e for e in evs if e.kind == ev.Kind.COMPUTE_AUDITED]
    if not tally.last and not verdicts and not audits:
        return None
    return {
        "checks": tally.checks,
        "nodes": len(tally.nodes),
        "last_agreed_step": tally.newest,
        "verdicts": verdicts,
        # compute audits (steadfast.sdc.ComputeAudit): every rank, each audit
        "audits": len(audits),
        "last_audit_step": audits[-1].step if audits else None,
        "audit_every": audits[-1].get("every") if audits else None,
    }


def replica_lines(summary: dict[str, Any] | None) -> list[str]:
    """The report's lines for :func:`replica_summary`'s answer."""
    if summary is None:
        return []
    clean = summary["last_agreed_step"]
    lines = []
    if summary["checks"] or not summary["audits"]:
        lines.append(
            f"  replicas: {summary['checks']} check(s) agreed on {summary['nodes']} node(s); "
            f"newest step proven clean: {'none' if clean is None else clean}"
        )
    if summary["audits"]:
        lines.append(
            f"  compute audits: {summary['audits']} (every rank's step recomputed by the "
            f"next rank, every {summary['audit_every']} steps); each rank last audited "
            f"at step {summary['last_audit_step']}"
        )
    for v in summary["verdicts"]:
        culprits, hosts = _list(v.get("culprits")), _list(v.get("hosts"))
        who = ", ".join(f"rank {r} ({h})" for r, h in zip(culprits, hosts, strict=False))
        kind = "the odd one out" if v.get("cause") == "odd_one_out" else "one of the pair"
        lines.append(
            f"  SILENT CORRUPTION: {who}: {kind} among {v.get('replicas')} replicas; last "
            f"step all agreed {v.get('last_agreed_step')}, first that disagreed "
            f"{v.get('first_bad_step')}"
        )
    return lines


def _list(value: object) -> list[Any]:
    """A list field of an event, or [] (a hand-edited or older log has another type)."""
    return value if isinstance(value, list) else []
