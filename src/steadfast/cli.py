"""The ``steadfast`` command: ``demo`` (what ``make demo`` runs) and ``health``.

``steadfast demo`` runs ``examples/train.py`` on N CPU ranks (gloo) under torchrun three
times: a fault-free reference; the same run with a NaN injected on one rank and a
SIGTERM sent to one rank mid-run (every rank saves and stops after the same step); and
the rerun, which resumes from the latest checkpoint. It ends with a report of the events
and whether the resumed run's final parameters equal the reference bit for bit.
(``steadfast launch`` and the full demo with every fault arrive with the launcher.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import events

__all__ = ["main"]


def _find_train_script(explicit: str | None) -> Path:
    candidates = [Path(explicit)] if explicit else []
    candidates += [
        Path.cwd() / "examples" / "train.py",
        Path(__file__).resolve().parents[2] / "examples" / "train.py",
    ]
    for c in candidates:
        if c.is_file():
            return c
    raise SystemExit(
        "steadfast demo: cannot find examples/train.py (looked in: "
        + ", ".join(str(c) for c in candidates)
        + "); run it from a steadfast checkout or pass --script"
    )


def _launch(
    nproc: int, script: Path, args: list[str], env: dict[str, str]
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "steadfast.cli",
        "launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        "--ft-param-rank_section_timeouts=setup:120,step:20,checkpointing:60",
        "--ft-param-rank_out_of_section_timeout=30",
        str(script),
        *args,
    ]
    return subprocess.Popen(cmd, env=env)


def _progress(progress_dir: Path, rank: int) -> tuple[int, int] | None:
    path = progress_dir / f"rank{rank}"
    try:
        pid, step = path.read_text().split()
        return int(pid), int(step)
    except (OSError, ValueError):
        return None


def _final_params(path: Path) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _demo(ns: argparse.Namespace) -> int:
    import torch

    script = _find_train_script(ns.script)
    work = Path(ns.workdir).resolve()
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    steps, sigterm_at = ns.steps, ns.sigterm_at
    if not 0 < sigterm_at < steps - 1:
        raise SystemExit(f"steadfast demo: --sigterm-at must be between 1 and {steps - 2}")
    if not 0 < ns.kill_at < sigterm_at:
        raise SystemExit("steadfast demo: --kill-at must be between 1 and --sigterm-at")
    nan_steps = ns.nan_steps
    common = [
        "--steps",
        str(steps),
        "--save-every",
        str(ns.save_every),
        "--nan-steps",
        nan_steps,
        "--nan-rank",
        str(ns.nproc - 1),
    ]

    def say(msg: str) -> None:
        print(f"[demo] {msg}", flush=True)

    # 1. reference run, no interruption
    say(f"1/3 fault-free reference: {ns.nproc} ranks x {steps} steps (NaN on steps {nan_steps})")
    ref_env = dict(env, STEADFAST_EVENTS=str(work / "reference" / "events.jsonl"))
    ref = _launch(
        ns.nproc,
        script,
        [
            *common,
            "--ckpt-dir",
            str(work / "reference" / "ckpt"),
            "--out",
            str(work / "reference" / "final.pt"),
        ],
        ref_env,
    )
    if ref.wait() != 0:
        say(f"reference run failed with exit code {ref.returncode}")
        return 1

    # 2. the same run, with SIGTERM delivered to the last rank mid-run
    run_events = work / "run" / "events.jsonl"
    run_env = dict(env, STEADFAST_EVENTS=str(run_events))
    run_args = [
        *common,
        "--ckpt-dir",
        str(work / "run" / "ckpt"),
        "--out",
        str(work / "run" / "final.pt"),
        "--step-sleep",
        str(ns.step_sleep),
        "--progress-dir",
        str(work / "run" / "progress"),
    ]
    faulted_args = [*run_args, "--kill-at", str(ns.kill_at), "--kill-rank", str(ns.nproc - 1)]
    say(
        f"2/3 faulted run under steadfast launch: rank {ns.nproc - 1} killed at step "
        f"{ns.kill_at} (in-job restart), then SIGTERM once it passes step {sigterm_at}"
    )
    proc = _launch(ns.nproc, script, faulted_args, run_env)
    target = ns.nproc - 1
    sent = False
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        seen = _progress(work / "run" / "progress", target)
        if not sent and seen is not None and seen[1] >= sigterm_at:
            os.kill(seen[0], signal.SIGTERM)
            say(f"sent SIGTERM to rank {target} (pid {seen[0]}) at step {seen[1]}")
            sent = True
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        say("faulted run did not stop in time")
        return 1
    if proc.returncode != 0 or not sent:
        say(f"faulted run ended with exit code {proc.returncode} (signal sent: {sent})")
        return 1

    # 3. rerun: resumes from the latest checkpoint
    say("3/3 rerun: resume from the latest checkpoint")
    rerun = _launch(ns.nproc, script, run_args, run_env)
    if rerun.wait() != 0:
        say(f"rerun failed with exit code {rerun.returncode}")
        return 1

    # report
    evs = list(events.read_events(run_events))
    kinds = Counter(e.kind for e in evs)
    print("\n== steadfast demo report ==")
    for e in evs:
        if e.kind in (
            "nan_detected",
            "nan_rollback_recommended",
            "shutdown_requested",
            "shutdown_agreed",
            "checkpoint_saved",
            "job_start",
            "fault_injected",
            "rank_failed",
            "rank_hung",
            "restart",
        ):
            extra = {
                k: v
                for k, v in e.fields.items()
                if k
                in ("resumed_from", "ranks_affected", "ranks_signalled", "path", "restart_count")
            }
            print(
                f"  rank {e.rank} step {e.step}: {e.kind} ({e.cause}) "
                f"{json.dumps(extra) if extra else ''}"
            )
    stops = {e.rank: e.step for e in evs if e.kind == "job_end" and e.cause == "shutdown"}
    same_step = len(set(stops.values())) == 1 and len(stops) == ns.nproc
    ref_params = _final_params(work / "reference" / "final.pt")
    run_params = _final_params(work / "run" / "final.pt")
    exact = ref_params.keys() == run_params.keys() and all(
        torch.equal(ref_params[k], run_params[k]) for k in ref_params
    )
    nan_steps_seen = sorted(
        {e.step for e in evs if e.kind == "nan_detected" and e.step is not None}
    )
    print(f"  NaN steps detected: {nan_steps_seen}")
    print(
        f"  shutdown: all {ns.nproc} ranks stopped after the same step: "
        f"{'yes' if same_step else 'NO'} ({stops})"
    )
    print(
        f"  checkpoints saved: {kinds['checkpoint_saved']}; events logged: {len(evs)} "
        f"in {run_events}"
    )
    print(f"  final parameters equal the fault-free run bit for bit: {'YES' if exact else 'NO'}")
    print(f"  in-job restarts after a killed rank: {kinds['restart']}")
    ok = (
        exact
        and same_step
        and kinds["nan_detected"] > 0
        and kinds["shutdown_requested"] > 0
        and kinds["restart"] > 0
    )
    print(f"  verdict: {'every injected fault was detected and recovered' if ok else 'FAILED'}")
    return 0 if ok else 1


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
    demo = sub.add_parser("demo", help="run the fault-injection demo on CPU ranks")
    demo.add_argument("--workdir", default="runs/demo", help="where runs are written")
    demo.add_argument("--nproc", type=int, default=2, help="number of ranks")
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--save-every", type=int, default=10)
    demo.add_argument("--nan-steps", default="12", help="comma-separated NaN steps")
    demo.add_argument("--sigterm-at", type=int, default=22, help="step to send SIGTERM at")
    demo.add_argument("--kill-at", type=int, default=16, help="step a rank is SIGKILLed at")
    demo.add_argument("--step-sleep", type=float, default=0.05)
    demo.add_argument("--script", default=None, help="training script (default examples/train.py)")
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
