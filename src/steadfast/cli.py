"""The ``steadfast`` command: ``launch``, ``demo`` (what ``make demo`` runs), ``report``,
``health``, ``slurm`` (writes a batch script), ``requeue`` and ``nodes`` (the node
ledger, :mod:`steadfast.ledger`).

``steadfast demo`` runs ``examples/train.py`` under ``steadfast launch`` with a scripted
sequence of faults and ends with the run's report (see :mod:`steadfast.demo`);
``steadfast report RUN_DIR`` prints the goodput report of any run's event log and draws
its timeline (see :mod:`steadfast.report`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import events

__all__ = ["main"]


def _demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(ns)


def _report(ns: argparse.Namespace) -> int:
    from .report import compute_report, format_report, load_events, plot_timeline

    source = Path(ns.path)
    try:
        evs, problems = load_events(source)
    except events.EventLogError as exc:
        print(f"steadfast report: {exc}", file=sys.stderr)
        return 2
    report = compute_report(evs, problems)
    picture: Path | None = None
    if not ns.no_timeline:
        target = (
            Path(ns.timeline)
            if ns.timeline
            else (source if source.is_dir() else source.parent) / "timeline.png"
        )
        try:
            picture = plot_timeline(evs, target, title=str(source))
        except ImportError as exc:
            report.problems.append(f"no timeline picture: {exc}")
    if ns.json:
        out = report.to_dict()
        out["timeline"] = str(picture) if picture else None
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report, title=str(source)))
        if picture is not None:
            print(f"  timeline: {picture}")
    return 0


def _health(ns: argparse.Namespace) -> int:
    if ns.when_asked:  # the launcher's next check, started ahead: import, then wait
        with contextlib.suppress(OSError):
            os.nice(19)  # beside the running workers: their CPU is theirs
    from .health import check_gpu_health

    if ns.when_asked:
        print("ready", flush=True)  # imported: a check now pays for CUDA's start alone
        if sys.stdin.readline() != "check\n":
            return 0  # not asked (the launcher closed it): nothing checked
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)  # asked: back to normal where allowed
    if ns.all_devices is not None:  # the launcher's node health check: each local GPU
        results = [check_gpu_health(d) for d in range(ns.all_devices)]
        print(json.dumps(results, indent=2))
        bad = [f"GPU {d}: {r['error']}" for d, r in enumerate(results) if r["error"]]
        if bad:
            print("; ".join(bad))
        return 1 if bad else 0
    result = check_gpu_health(ns.device)
    print(json.dumps(result, indent=2))
    healthy = not result["error"]
    return 0 if healthy or (ns.allow_no_cuda and not result["cuda_available"]) else 1


def _slurm(ns: argparse.Namespace) -> int:
    import shlex
    import subprocess
    from dataclasses import fields

    from .config import ConfigError
    from .slurm import SbatchSpec, render_sbatch

    try:  # the parser's destinations are SbatchSpec's field names
        spec = SbatchSpec(**{f.name: getattr(ns, f.name) for f in fields(SbatchSpec)})
        spec.exclude = _ledger_excluded(spec)
        spec.validate()
    except ConfigError as exc:
        print(f"steadfast slurm: {exc}", file=sys.stderr)
        return 2
    text = render_sbatch(spec, "steadfast slurm " + shlex.join(ns.argv))
    run_dir = Path(spec.run_dir or f"runs/{spec.job_name}")
    if ns.write is None and not ns.submit:
        sys.stdout.write(text)
        if spec.output is None and not run_dir.is_dir():
            print(
                f"steadfast slurm: create {run_dir} before sbatch: Slurm opens the output "
                "there before the script runs",
                file=sys.stderr,
            )
        return 0
    # Slurm opens the output file before the script runs and does not create folders
    run_dir.mkdir(parents=True, exist_ok=True)
    target = Path(ns.write or f"{spec.job_name}.sbatch")
    target.write_text(text)
    target.chmod(0o755)
    print(f"steadfast slurm: wrote {target}", file=sys.stderr)
    if not ns.submit:
        return 0
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(target)], capture_output=True, text=True)
    except OSError as exc:
        print(f"steadfast slurm: cannot run sbatch: {exc}", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(f"steadfast slurm: sbatch failed: {proc.stderr.strip()}", file=sys.stderr)
        return proc.returncode
    print(proc.stdout.strip().split(";")[0])  # the job id
    return 0


def _ledger_excluded(spec: Any) -> list[str]:
    """The nodes the node ledger keeps out of the job (said on stderr), and those the
    user excluded."""
    from .config import ConfigError
    from .ledger import LedgerError, excluded_nodes

    if not (spec.node_ledger and spec.node_ledger_max_faults):
        return list(spec.exclude)
    try:
        kept_out = excluded_nodes(
            spec.node_ledger, spec.node_ledger_max_faults, spec.node_ledger_window_days
        )
    except LedgerError as exc:
        raise ConfigError(f"node_ledger: {exc}") from None
    if kept_out:
        print(
            f"steadfast slurm: the node ledger keeps {', '.join(kept_out)} out of the job "
            f"(at least {spec.node_ledger_max_faults} faults in {spec.node_ledger_window_days:g}"
            " days: steadfast nodes says which)",
            file=sys.stderr,
        )
    return sorted({*spec.exclude, *kept_out})


def _requeue(ns: argparse.Namespace) -> int:
    from .slurm import requeue_job

    return 0 if requeue_job(ns.job, cause=ns.cause) else 1


def _add_slurm_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .slurm import SbatchSpec

    d = SbatchSpec.__dataclass_fields__  # the defaults live in one place
    p = sub.add_parser(
        "slurm",
        help="write (and optionally submit) an sbatch script: steadfast launch on N nodes",
        description="Write a batch script that runs `steadfast launch` once per node "
        "through srun, with a rendezvous on the first node, in-job restarts, job "
        "retries (the launcher requeues the job) and the preemption signal forwarded to "
        "the ranks. Printed to stdout unless --write or --submit.",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own flags")
    p.add_argument("--nodes", type=int, default=d["nodes"].default, help="nodes that train")
    p.add_argument(
        "--spare-nodes",
        type=int,
        default=d["spare_nodes"].default,
        help="nodes allocated beyond --nodes that wait as spares: a lost node's place is "
        "taken by one of them, with no requeue",
    )
    p.add_argument(
        "--nproc-per-node",
        default=d["nproc_per_node"].default,
        help="ranks per node: a number, gpu, cpu or auto",
    )
    p.add_argument("--job-name", default=d["job_name"].default)
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", help="Slurm time limit (e.g. 4:00:00); enables --signal")
    p.add_argument("--output", help="default: RUN_DIR/slurm-%%j.out")
    p.add_argument("--error", help="default: with the output")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument(
        "--preempt-signal",
        default=d["preempt_signal"].default,
        help="sent to the batch shell PREEMPT_TIME s before the time limit "
        "(USR1, USR2, TERM, HUP, QUIT or ALRM)",
    )
    p.add_argument("--preempt-time", type=int, default=d["preempt_time"].default)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=d["max_restarts"].default,
        help="in-job restarts (every node's ranks restart)",
    )
    p.add_argument(
        "--num-job-retries-on-failure",
        type=int,
        default=d["num_job_retries_on_failure"].default,
        help="requeues after the in-job restarts are spent",
    )
    p.add_argument("--rdzv-port", type=int, help="default: 29400 + the job id %% 1000")
    p.add_argument(
        "--rdzv-backend",
        default=d["rdzv_backend"].default,
        help="steadfast (default: steadfast's own rendezvous, O(1) store traffic per node) or "
        "c10d (torch's), the store on the first node; or etcd-v2 with --rdzv-endpoint: an "
        "etcd cluster outside the job, so that losing the first node does not end it",
    )
    p.add_argument(
        "--rdzv-endpoint",
        help="with etcd-v2: the etcd cluster's client addresses, host1:2379,host2:2379,...",
    )
    p.add_argument(
        "--run-dir", help="event log and output of every incarnation (default runs/JOB_NAME)"
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the Python that has steadfast (default: this one)",
    )
    p.add_argument(
        "--sbatch",
        dest="sbatch_lines",
        action="append",
        default=[],
        metavar="OPTION",
        help="an extra #SBATCH option, e.g. --sbatch=--qos=high (repeatable)",
    )
    p.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line run before srun (repeatable)",
    )
    p.add_argument(
        "--launcher-arg",
        dest="launcher_args",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra steadfast launch flag, e.g. --launcher-arg=--ft-cfg-path=ft.yaml",
    )
    p.add_argument(
        "--srun-arg",
        dest="srun_args",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra srun flag (repeatable)",
    )
    p.add_argument(
        "--node-ledger",
        default=os.environ.get("STEADFAST_NODE_LEDGER") or None,
        metavar="LOCATION",
        help="the node ledger (a shared folder, or etcd://host:2379/prefix; default "
        "$STEADFAST_NODE_LEDGER): every launcher records its node's hours and faults there",
    )
    p.add_argument(
        "--node-ledger-max-faults",
        type=int,
        default=d["node_ledger_max_faults"].default,
        metavar="N",
        help="keep out of the job the nodes with N faults in the ledger (0: off)",
    )
    p.add_argument(
        "--node-ledger-window-days",
        type=float,
        default=d["node_ledger_window_days"].default,
        metavar="DAYS",
        help="the window the ledger's faults are counted over",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NODE",
        help="a node to keep out of the job (repeatable), besides the ledger's",
    )
    p.add_argument("--write", metavar="FILE", help="write the script to FILE")
    p.add_argument(
        "--submit",
        action="store_true",
        help="write it (to --write or JOB_NAME.sbatch) and sbatch it; prints the job id",
    )
    p.set_defaults(func=_slurm)
    r = sub.add_parser(
        "requeue", help="requeue this Slurm job (scontrol requeue) and record a job_requeued event"
    )
    r.add_argument("--job", default=None, help="job id (default: $SLURM_JOB_ID)")
    r.add_argument("--cause", default="preempted", help="the event's cause")
    r.set_defaults(func=_requeue)


def build_parser() -> argparse.ArgumentParser:
    """The ``steadfast`` argument parser (sub-commands ``demo``, ``launch``, ``report``,
    ``health``, ``slurm``, ``requeue``)."""
    parser = argparse.ArgumentParser(prog="steadfast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="a training run under steadfast launch with injected faults, and its report"
    )
    from .demo import add_arguments

    add_arguments(demo)
    demo.set_defaults(func=_demo)
    sub.add_parser(
        "launch",
        help="torchrun with hang detection and in-job restarts (torchrun flags + --ft-*)",
        add_help=False,
    )
    report = sub.add_parser(
        "report", help="goodput, time lost by cause and each fault, from a run's event log"
    )
    report.add_argument("path", help="a run directory (its events*.jsonl) or an events file")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.add_argument("--timeline", default=None, help="where to write timeline.png")
    report.add_argument("--no-timeline", action="store_true", help="do not draw the picture")
    report.set_defaults(func=_report)
    health = sub.add_parser("health", help="check this node's GPU")
    health.add_argument("--device", type=int, default=0)
    health.add_argument("--allow-no-cuda", action="store_true", help="exit 0 on CPU-only nodes")
    health.add_argument(
        "--all-devices",
        type=int,
        metavar="N",
        help="check devices 0..N-1; the last line names each unhealthy one",
    )
    health.add_argument(
        "--when-asked",
        action="store_true",
        help="import torch, then wait for a line 'check' on stdin (the launcher's next "
        "check, started ahead)",
    )
    health.set_defaults(func=_health)
    _add_slurm_parser(sub)
    from .ledger.table import add_nodes_parser
    from .watch import add_watch_parser

    add_nodes_parser(sub)
    add_watch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``steadfast`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["launch"]:  # its flags are torchrun's and --ft-*: passed through whole
        from .launcher import main as launch_main

        return launch_main(args[1:], entry=argv is None)
    ns = build_parser().parse_args(args)
    ns.argv = args[1:]
    code: int = ns.func(ns)
    return code


def console_main() -> None:
    """Entry point of the ``steadfast`` console script: ``steadfast launch`` ends its
    process at once after its work (see :func:`steadfast.launcher.exit_now`)."""
    code = main()
    if sys.argv[1:2] == ["launch"]:
        from .launcher import exit_now

        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
