"""The ``steadfast`` command: ``launch``, ``demo`` (what ``make demo`` runs), ``report``
and ``health``.

``steadfast demo`` runs ``examples/train.py`` under ``steadfast launch`` with a scripted
sequence of faults and ends with the run's report (see :mod:`steadfast.demo`);
``steadfast report RUN_DIR`` prints the goodput report of any run's event log and draws
its timeline (see :mod:`steadfast.report`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
        target = Path(ns.timeline) if ns.timeline else (
            source if source.is_dir() else source.parent) / "timeline.png"  # fmt: skip
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
    from .health import check_gpu_health

    result = check_gpu_health(ns.device)
    print(json.dumps(result, indent=2))
    healthy = not result["error"]
    return 0 if healthy or (ns.allow_no_cuda and not result["cuda_available"]) else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``steadfast`` argument parser (sub-commands ``demo``, ``launch``, ``health``)."""
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
    health.set_defaults(func=_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``steadfast`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["launch"]:  # its flags are torchrun's and --ft-*: passed through whole
        from .launcher import main as launch_main

        return launch_main(args[1:])
    ns = build_parser().parse_args(args)
    code: int = ns.func(ns)
    return code


if __name__ == "__main__":
    sys.exit(main())
