"""``steadfast demo``: a real training run under ``steadfast launch`` with a scripted
sequence of injected faults, a live progress line, and the goodput report at the end.

The run is ``examples/train.py`` (DDP on N CPU ranks with gloo, or GPUs with NCCL): a
fault-free reference first (fast, unpaced), then the paced run with the faults, in this
order across the run: a NaN burst (every rank skips, then rolls back to the latest
checkpoint), a killed rank (in-job restart), a hung rank (caught by the calculated step
timeout, in-job restart), a slowed rank (straggler report), and a SIGTERM (every rank saves
and exits after the same step; the demo resumes the run, as a requeued job would). The
final parameters are compared with the reference's, bit for bit.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import events
from .faults import FaultKind
from .straggler.detector import FIRST_REPORT_CALLS

__all__ = ["FAULTS", "add_arguments", "run_demo"]

#: The demo's faults by their short flag names (``--faults``), and what they inject.
_KINDS = {
    "nan": FaultKind.NAN_BURST,
    "kill": FaultKind.RANK_KILLED,
    "hang": FaultKind.RANK_HUNG,
    "slow": FaultKind.SLOW_RANK,
    "sigterm": FaultKind.SIGTERM,
}
FAULTS = tuple(_KINDS)
#: Rough fixed cost of a demo's run outside its paced steps (start-ups, restarts), used to
#: turn --duration into a pace.
_OVERHEAD_S = 22.0
#: Seconds between straggler reports in the paced run: short, so that a slowed rank is
#: reported within 2 s; each report is one all_gather of small summaries, started at one
#: step and read at the next (StragglerDetectionManager.check): no step waits for it.
STRAGGLER_INTERVAL = 0.5
#: The least calculated step timeout (seconds): NVRx's default factor (5 x the longest
#: step) is raised for a quick demo's short steps, so that a loaded machine's scheduling
#: delay is not taken for a hang.
MIN_STEP_TIMEOUT = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``steadfast demo`` flags."""
    p.add_argument("--quick", action="store_true", help="a short run (CI): about 40 s")
    p.add_argument("--duration", type=float, default=None, help="seconds (default 90)")
    p.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200)")
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated subset of {','.join(FAULTS)} (default: all)",
    )
    p.add_argument("--workdir", default="runs/demo", help="where runs are written")
    p.add_argument(
        "--memory-every",
        type=int,
        default=1,
        help="memory-tier snapshots every N steps (default 1; 0: disk checkpoints only)",
    )
    p.add_argument("--script", default=None, help="training script (default examples/train.py)")


def _find_script(explicit: str | None) -> Path:
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


class _Plan:
    """Steps, pace and the step of each fault, from the flags."""

    def __init__(self, ns: argparse.Namespace) -> None:
        chosen = [f.strip() for f in ns.faults.split(",") if f.strip()]
        unknown = sorted(set(chosen) - set(FAULTS))
        if unknown:
            raise SystemExit(
                f"steadfast demo: --faults: unknown {', '.join(unknown)}; "
                f"choose from {', '.join(FAULTS)}"
            )
        if ns.nproc < 2:
            raise SystemExit("steadfast demo: --nproc must be at least 2")
        self.faults = set(chosen)
        duration = ns.duration if ns.duration is not None else (28.0 if ns.quick else 90.0)
        if duration <= 0:
            raise SystemExit("steadfast demo: --duration must be positive")
        self.steps = ns.steps or (60 if ns.quick else 200)
        if self.steps < 40:
            raise SystemExit("steadfast demo: --steps must be at least 40")
        self.pace = max(0.02, (duration - _OVERHEAD_S) / self.steps)
        self.safety_factor = max(5.0, MIN_STEP_TIMEOUT / self.pace)
        s = self.steps
        self.save_every = max(5, s // 10)
        self.calc_at = max(8, s // 12)
        at = {
            "nan": self.save_every * 2 + 3,  # 3 steps after a save: that work is re-done
            "kill": int(0.35 * s),
            "hang": int(0.5 * s),
            "slow": int(0.62 * s),
            "sigterm": int(0.8 * s),
        }
        self.at = {k: v for k, v in at.items() if k in self.faults}

    def script_args(self, rank: int) -> list[str]:
        """The training script's flags: pace, and a ``--fault`` spec per injected fault
        on ``rank`` (the SIGTERM comes from the demo itself, as a scheduler's would)."""
        # the slowed rank's forward (its compute: the pace) takes twice as long; with a
        # straggler report every STRAGGLER_INTERVAL s (every step at the full demo's pace)
        # its report at the end of its 2nd slow step (the scoring window's floor,
        # steadfast.straggler.detector) says so, read at the next step: 5 x pace after
        # it began. It stays slow for 2
        # steps and 2 report intervals, and at least until the first report of a process
        # (restarted just before the slowdown, say) at its FIRST_REPORT_CALLS-th step
        slow = 2 * self.pace
        slow_steps = max(FIRST_REPORT_CALLS, 2 + math.ceil(2 * STRAGGLER_INTERVAL / slow))
        length = {"nan": 3, "slow": slow_steps}
        out = [
            "--step-sleep", str(self.pace),
            "--slow-seconds", str(round(self.pace, 4)),
            "--straggler-interval", str(STRAGGLER_INTERVAL),
        ]  # fmt: skip
        for fault, step in self.at.items():
            if fault != "sigterm":
                spec = f"{_KINDS[fault].value}:{rank}:{step}"
                out += ["--fault", spec + (f":{length[fault]}" if fault in length else "")]
        return out


def _launch(
    nproc: int,
    script: Path,
    args: list[str],
    env: dict[str, str],
    log_path: Path,
    safety_factor: float = 5.0,
) -> subprocess.Popen[str]:
    """``steadfast launch`` of ``script``; its output is appended to ``log_path``."""
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
        f"--nproc-per-node={nproc}", "--max-restarts=3", "--monitor-interval=0.1",
        "--ft-param-rank_section_timeouts=setup:120,step:30,checkpointing:60",
        "--ft-param-rank_out_of_section_timeout=30",
        f"--ft-param-safety_factor={safety_factor:g}", "--ft-param-workers_stop_timeout=5",
        str(script), *args,
    ]  # fmt: skip
    log = open(log_path, "a")  # noqa: SIM115 - closed with the process
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    finally:
        log.close()


class _Progress:
    """Follows the run's event log: one live line on a terminal, plain lines otherwise."""

    def __init__(self, path: Path, tty: bool) -> None:
        self.path, self.tty = path, tty
        self.offset = 0
        self.events: list[events.Event] = []
        self.last_note = ""
        self.printed_note = ""
        self.last_draw = 0.0
        self.width = 0

    def poll(self) -> None:
        """Read the lines appended since the last poll (whole lines only)."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for raw in data[:end].decode(errors="replace").splitlines():
            if not raw.strip():
                continue
            try:
                e = events.parse_event(raw, str(self.path))
            except events.EventLogError:
                continue
            self.events.append(e)
            if e.kind not in (
                events.Kind.STEP_DONE,
                events.Kind.CHECKPOINT_SAVED,
                events.Kind.STRAGGLER_REPORT,
                events.Kind.JOB_END,
            ):
                rank = "" if e.rank is None else f" rank {e.rank}"
                self.last_note = f"{e.kind}{rank}" + (f" ({e.cause})" if e.cause else "")

    def rank0_steps(self) -> list[events.Event]:
        return [e for e in self.events if e.kind == events.Kind.STEP_DONE and e.rank == 0]

    def step_of(self, rank: int) -> tuple[int, int] | None:
        """(step, pid) of ``rank``'s latest completed step."""
        for e in reversed(self.events):
            if e.kind == events.Kind.STEP_DONE and e.rank == rank and e.step is not None:
                return e.step, int(e.get("pid") or 0)
        return None

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        too_soon = now - self.last_draw < (0.25 if self.tty else 5.0)
        news = not self.tty and self.last_note != self.printed_note  # a line per new event
        if not force and too_soon and not news:
            return
        self.last_draw = now
        steps = self.rank0_steps()
        if not steps:
            line = "[demo] starting ..."
        else:
            last = steps[-1]
            recent = [e for e in steps if e.time >= last.time - 3.0]
            rate = (
                (len(recent) - 1) / (recent[-1].time - recent[0].time) if len(recent) > 1 else 0.0
            )
            from .report import compute_report

            goodput = compute_report(self.events).goodput
            loss = last.get("loss")
            loss_s = f"{loss:.4f}" if isinstance(loss, float) else "-"
            line = (
                f"[demo] step {last.step:>4}  loss {loss_s:>8}  {rate:5.1f} steps/s  "
                f"goodput {100 * goodput:5.1f} %  last event: {self.last_note or '-'}"
            )
        if self.tty:
            pad = max(0, self.width - len(line))
            sys.stdout.write("\r" + line + " " * pad)
            sys.stdout.flush()
            self.width = len(line)
        else:
            print(line, flush=True)
        self.printed_note = self.last_note

    def follow(
        self, proc: subprocess.Popen[str], limit: float, tick: Callable[[], None] | None = None
    ) -> int | None:
        """Show the progress until ``proc`` ends (its exit code) or ``limit`` seconds pass
        (None: it was killed); ``tick`` runs at each refresh."""
        deadline = time.monotonic() + limit
        while proc.poll() is None and time.monotonic() < deadline:
            self.poll()
            if tick is not None:
                tick()
            self.draw()
            time.sleep(0.05)
        timed_out = proc.poll() is None
        if timed_out:
            proc.kill()
            proc.wait()
        self.poll()
        self.draw(force=True)
        self.end_line()
        return None if timed_out else proc.returncode

    def end_line(self) -> None:
        if self.tty and self.width:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.width = 0


def _outcome(code: int | None) -> str:
    return "did not finish in time" if code is None else f"exit {code}"


def _final_params(path: Path) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def run_demo(ns: argparse.Namespace) -> int:
    """Run the demo; 0 when every injected fault was detected and recovered and the final
    parameters equal the reference's bit for bit."""
    import torch

    from .report import compute_report, format_report, load_events, plot_timeline

    plan = _Plan(ns)
    script = _find_script(ns.script)
    work = Path(ns.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    (work / "reference").mkdir(parents=True)
    (work / "run").mkdir(parents=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    tty = sys.stdout.isatty()

    def say(msg: str) -> None:
        print(f"[demo] {msg}", flush=True)

    common = ["--steps", str(plan.steps), "--save-every", str(plan.save_every),
              "--memory-every", str(ns.memory_every)]  # fmt: skip
    say(
        f"{ns.nproc} ranks x {plan.steps} steps under steadfast launch; faults: "
        + (", ".join(f"{k} at step {v}" for k, v in plan.at.items()) or "none")
    )
    say("1/3 fault-free reference (unpaced)")
    ref_env = dict(env, STEADFAST_EVENTS=str(work / "reference" / "events.jsonl"))
    ref_log = work / "reference" / "launcher.log"
    # no straggler detection in the unpaced reference: its forward, under a millisecond
    # on a CPU, is mostly the noise of a shared machine (its first report, over 10 such
    # samples, flagged a healthy rank once in two runs)
    ref = _launch(ns.nproc, script, [*common, "--ckpt-dir", str(work / "reference" / "ckpt"),
                                     "--out", str(work / "reference" / "final.pt"),
                                     "--calc-timeouts-at", "-1", "--straggler-interval", "0"],
                  ref_env, ref_log)  # fmt: skip
    if ref.wait() != 0:
        say(f"reference run failed (exit {ref.returncode}); see {ref_log}")
        return 1

    run_events = work / "run" / "events.jsonl"
    run_env = dict(env, STEADFAST_EVENTS=str(run_events))
    run_log = work / "run" / "launcher.log"
    run_args = [
        *common, "--ckpt-dir", str(work / "run" / "ckpt"), "--out", str(work / "run" / "final.pt"),
        "--calc-timeouts-at", str(plan.calc_at), *plan.script_args(ns.nproc - 1),
    ]  # fmt: skip
    say(f"2/3 the run with faults (log: {run_log})")
    progress = _Progress(run_events, tty)
    target = ns.nproc - 1
    sigterm_at = plan.at.get("sigterm")
    limit = max(600.0, 10 * plan.steps * plan.pace)
    sent = False

    def preempt() -> None:  # the scheduler's notice, once rank 1 has passed the step
        nonlocal sent
        seen = progress.step_of(target)
        if sigterm_at is None or sent or seen is None or seen[0] < sigterm_at:
            return
        os.environ[events.EVENTS_ENV] = str(run_events)
        sigterm = FaultKind.SIGTERM.value
        events.emit("fault_injected", step=seen[0], rank=target, cause=sigterm, fault=sigterm)
        os.kill(seen[1], signal.SIGTERM)
        sent = True

    safety = plan.safety_factor
    code = progress.follow(
        _launch(ns.nproc, script, run_args, run_env, run_log, safety), limit, preempt
    )
    if code != 0:
        say(f"the run failed ({_outcome(code)}); see {run_log}")
        return 1
    if sent:
        say("3/3 stopped by the SIGTERM with a checkpoint; resuming, as a requeued job would")
        code = progress.follow(_launch(ns.nproc, script, run_args, run_env, run_log, safety), limit)
        if code != 0:
            say(f"the resumed run failed ({_outcome(code)})")
            return 1

    evs, problems = load_events(run_events)
    report = compute_report(evs, problems)
    print()
    print(format_report(report, title=str(work / "run")))
    try:
        picture = plot_timeline(evs, work / "run" / "timeline.png", title="steadfast demo")
        print(f"  timeline: {picture}")
    except ImportError as exc:
        print(f"  timeline: not drawn ({exc})")
    ref_params = _final_params(work / "reference" / "final.pt")
    run_params = _final_params(work / "run" / "final.pt")
    exact = ref_params.keys() == run_params.keys() and all(
        torch.equal(ref_params[k], run_params[k]) for k in ref_params
    )
    print(f"  final parameters equal the fault-free run bit for bit: {'YES' if exact else 'NO'}")
    injected = {r.fault for r in report.faults}
    missing = sorted(_KINDS[f].value for f in plan.faults if _KINDS[f].value not in injected)
    if missing:
        print(f"  faults planned but never injected: {', '.join(missing)}")
    ok = exact and report.all_recovered and not missing
    print(f"  demo: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1
