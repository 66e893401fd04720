"""Every fault's cost in one table (issue 52): each fault kind measured in one run of this
bench, split into the report's restart phases, beside torchrun where torchrun recovers,
and written as the JSON ``bench_goodput_projection.py --costs`` reads.

    .venv/bin/python bench/bench_fault_costs.py [--out fault_costs.json] [--skip nodes]
    .venv/bin/python bench/bench_goodput_projection.py --costs fault_costs.json

The jobs (2 gloo ranks a node, this machine's CPUs; each fault's first-step time is the
last rank's):

- ``demo``: ``steadfast demo`` as ``make demo`` runs it (``examples/train.py``, a memory
  snapshot every step, a disk checkpoint every 20 steps): a NaN streak (every rank skips,
  then rolls back), a killed rank and a hung rank (in-job restarts), a slowed rank (the
  straggler report) and a SIGTERM (every rank saves after the same step; the demo starts
  the launcher again, the shape a Slurm requeue runs). Its report's faults and restarts
  give those rows, and its goodput is set beside what the table predicts for it.
- ``frozen``: a torchrun script that imports nothing of steadfast
  (``tests/e2e/unchanged_train.py``), rank 1 SIGSTOPped mid-run: found by progress
  watching alone, restarted from the script's own snapshot.
- ``proof``: a restore whose proof fails (``tests/e2e/proof_loop.py``: the memory
  snapshot the restart would restore swapped for another step's, whole and with valid
  checksums): the mismatch, then the disk tier, proven.
- ``kill``: the same killed rank (``bench/_restart_worker.py``) under ``steadfast launch``
  and under torchrun, the baseline of the row.
- ``hang``: the same hung rank (``bench/_hang_worker.py``: NVRx's documented heartbeat
  pattern, its timeouts calculated from the steps seen) under ``steadfast launch`` and
  NVRx's ``ft_launcher``, each at its defaults (torchrun has no hang detection of its
  own: NCCL's watchdog, 10 minutes, ends the job).
- ``nodes`` (root; ``scripts/nodes-localhost.sh``): a node killed while a spare waits,
  under steadfast's rendezvous, torch's c10d under ``steadfast launch``, and torchrun;
  and a node killed without a spare (``--nnodes 1:2``: the survivor goes on alone),
  steadfast and torchrun.

NVRx 0.4.1 runs where it is installed (``--nvrx PYTHON``, the environment
``NVRX_WHEEL=0.4.1 scripts/nvrx-env.sh .nvrx-0.4.1`` makes: its released wheel): the
killed rank and the hung rank under its ``ft_launcher`` (its in-job restart: a new
interpreter per worker, as torchrun's), which the projection then takes for NVRx's crash
and its hang's restart (its detection stays the model's, which scales with the step);
without it those rows are left out, and the projection keeps its assumed costs (their
source says so). With it, the ``nodes`` job also runs a lost node with a spare under
NVRx's ``ft_launcher`` (c10d, as its users type it) and, beside it, torchrun, on
``tests/e2e/unchanged_train.py`` (NVRx's environment has no steadfast to import; the
script keeps its own snapshot); without a spare a lost node ends an NVRx 0.4.1 job.

Columns (seconds): ``detect`` the fault to its detection; ``stop`` the old workers' exit;
``requeue`` the old launcher's end to the new one's (Slurm's shape); ``rdzv`` the health
check, the rendezvous and the launcher's own work; ``start`` the spawn to the script's
model (process start, imports, the process group, the script's setup); ``restore`` the
checkpoint load; ``step`` the first iteration (its batches and compile too); ``restart``
the detection to the first step, the sum of the phases; ``redo`` the steps done again
(from the last state kept to the fault), of which ``proof`` were done only for the proof.
A row's cost is ``detect + restart + redo x step``: a NaN streak's restart ends when its
rollback does (the streak's steps are in its detection and restart, the steps after the
rollback are kept), and a graceful stop's ``stop`` leaves out the steps done after the
signal, which the checkpoint it saves keeps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_launcher  # noqa: E402
import bench_node_loss  # noqa: E402
from steadfast import events as ev  # noqa: E402
from steadfast.report import compute_report, load_events  # noqa: E402

E2E = REPO / "tests" / "e2e"
#: The report's restart phases, grouped into the table's columns.
COLUMNS: dict[str, tuple[str, ...]] = {
    "stop": ("stopping",),
    "requeue": ("requeue",),
    "rdzv": ("health_check", "rendezvous", "launcher"),
    "start": ("process_start", "imports", "init_process_group", "setup", "inprocess_restart"),
    "restore": ("checkpoint_load", "refuted"),
    "step": ("first_batch", "compile", "first_step", "inprocess_first_step"),
}


@dataclass
class Row:
    """One fault's cost: seconds, None where the run has no such phase."""

    fault: str
    system: str
    detect: float | None
    restart: float | None
    phases: dict[str, float] = field(default_factory=dict)
    redo: int | None = None
    proof: int | None = None
    step_s: float | None = None  # the run's median step, to turn redo into seconds
    source: str = ""
    kept: int = 0  # steps done after the detection and kept (a graceful stop's)

    def column(self, name: str) -> float | None:
        parts = [self.phases[p] for p in COLUMNS[name] if p in self.phases]
        return sum(parts) if parts else None


def _step_time(evs: list[ev.Event]) -> float | None:
    times = sorted(e.time for e in evs if e.kind == ev.Kind.STEP_DONE and e.rank == 0)
    gaps = [b - a for a, b in itertools.pairwise(times) if b - a < 5.0]
    return statistics.median(gaps) if gaps else None


def _restart_rows(evs: list[ev.Event], system: str, source: str) -> list[Row]:
    """A row per fault the run's report saw, with its restart's phases where it had one."""
    report = compute_report(evs)
    step_s = _step_time(evs)
    rows = []
    for f in report.faults:
        near = [r for r in report.restarts_phases if abs(r["fault_time"] - f.time) < 1.0]
        r = near[0] if near else None
        detect = f.detection_latency
        kept = 0
        if r is None:  # recovered in the processes (a NaN streak's rollback), or none
            restart = f.recovery_time
            phases: dict[str, float] = {}
            redo = proof = None
            back = [e for e in evs if e.kind == ev.Kind.ROLLBACK and e.rank == 0
                    and e.time >= f.time and e.step is not None]  # fmt: skip
            if back and isinstance(back[0].get("to_step"), int) and detect is not None:
                # the detection to the rollback's end (the streak's other steps, the
                # restore): the step after it is kept, so not the recovery time, which
                # ends with it. Re-done: the steps from the state rolled back to until
                # the fault; those of the streak are the detection's and the restart's
                restart = back[0].time - (f.time + detect)
                if f.step is not None:
                    redo = max(0, f.step - back[0].get("to_step"))
        else:
            phases = {k: v for k, v in r["phases"].items() if k != "detection"}
            restart = sum(phases.values()) if r["seconds"] is not None else None
            if detect is None:
                detect = r["phases"].get("detection")
            pr = r.get("proof") or {}
            proof = pr.get("proof_steps")
            redo = None
            if isinstance(pr.get("step"), int):
                seen = f.time + (detect or 0.0)
                before = [e.step for e in evs if e.kind == ev.Kind.STEP_DONE and e.rank == 0
                          and e.step is not None and e.time <= seen]  # fmt: skip
                if before:
                    redo = max(0, max(before) + 1 - pr["step"])
                    kept = max(0, pr["step"] - max(before) - 1)
                if kept and "stopping" in phases:
                    # a graceful stop: the steps done after the signal are kept, so their
                    # time is training, not the stop's; what is left is the save and exit
                    kept_done = [e.time for e in evs if e.kind == ev.Kind.STEP_DONE
                                 and e.rank == 0 and e.step == pr["step"] - 1]  # fmt: skip
                    last = max(kept_done, default=seen)
                    phases["stopping"] = max(0.0, phases["stopping"] - (last - seen))
                    restart = sum(phases.values())
        rows.append(
            Row(f.fault, system, detect, restart, phases, redo, proof, step_s, source, kept)
        )
    return rows


def demo(work: Path) -> tuple[list[Row], dict[str, Any]]:
    """``steadfast demo`` (its default run): its faults' rows, and its goodput's parts."""
    out = work / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "demo", "--workdir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the demo failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    evs, _ = load_events(out / "run" / "events.jsonl")
    report = compute_report(evs)
    rows = _restart_rows(evs, "steadfast", "steadfast demo")
    first = min((e for e in evs if e.kind == ev.Kind.STEP_DONE and e.rank == 0),
                key=lambda e: e.time)  # fmt: skip
    return rows, {
        "wall": report.wall_time,
        "productive": report.productive_time,
        "goodput": report.goodput,
        "badput": report.badput,
        # the first launch's: the run's start (the report's) to its first step's start
        "cold_start": first.time
        - float(first.get("seconds") or 0.0)
        - (max(e.time for e in evs) - report.wall_time),
    }


def _wait_lines(path: Path, word: str, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_text().splitlines()
            if sum(1 for line in lines if line.startswith(word + " ")) >= count:
                return
        time.sleep(0.05)
    raise SystemExit(f"{path}: fewer than {count} {word!r} lines in {timeout} s")


def _launch(work: Path, name: str, *args: str) -> tuple[Path, Path, list[str]]:
    """A job's folder, its event log, and its ``steadfast launch`` command (2 ranks)."""
    out = work / name
    out.mkdir(parents=True)
    log = out / "events.jsonl"
    cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--events", str(log),
           "--nproc-per-node=2", *args]  # fmt: skip
    return out, log, cmd


def frozen(work: Path) -> list[Row]:
    """An unchanged torchrun script, rank 1 SIGSTOPped after 15 steps."""
    out, log, cmd = _launch(work, "frozen", "--max-restarts=2", str(E2E / "unchanged_train.py"))
    cmd += ["--out", str(out / "out.pt"), "--snapshot", str(out / "snap.pt"),
            "--trace", str(out / "trace")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_lines(out / "trace", "step", 15)
        [started] = [e for e in load_events(log)[0] if e.kind == ev.Kind.WORKERS_STARTED]
        pid = int(started.fields["pids"][1])
        os.environ[ev.EVENTS_ENV] = str(log)
        hung = "rank_hung"
        os.kill(pid, signal.SIGSTOP)
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.001)
        ev.emit("fault_injected", rank=1, cause=hung, fault=hung)
        if proc.wait(300) != 0:
            raise SystemExit(f"the frozen rank's run failed; see {log}")
    finally:
        os.environ.pop(ev.EVENTS_ENV, None)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = _restart_rows(load_events(log)[0], "steadfast", "an unchanged script, SIGSTOP")
    for r in rows:
        r.fault = "rank_frozen"
    return rows


def proof(work: Path) -> list[Row]:
    """A restore whose proof fails: the memory snapshot swapped, the disk tier proven."""
    out, log, cmd = _launch(
        work, "proof", "--monitor-interval=0.1", "--max-restarts=3", str(E2E / "proof_loop.py")
    )
    cmd += ["--ckpt", str(out / "ck"), "--out", str(out / "out.pt"), "--kill-at", "7",
            "--memory-every", "1", "--save-every", "4", "--swap-snapshots", "5", "6"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"the proof run failed; see {log}")
    evs = load_events(log)[0]
    if not any(e.kind == ev.Kind.RESTORE_MISMATCH for e in evs):
        raise SystemExit(f"the swapped snapshot was not caught; see {log}")
    # two restarts: the kill's, whose restore (the swapped snapshot) runs until its proof
    # fails ("refuted": those steps and the proof), then the one from the disk tier, proven
    [row] = _restart_rows(evs, "steadfast", "tests/e2e/proof_loop.py, a swapped snapshot")
    report = compute_report(evs)
    [fault] = report.faults
    first, last = [r for r in report.restarts_phases if r["fault_time"] >= fault.time - 1.0]
    phases: dict[str, float] = {}
    for r in (first, last):
        for k, v in r["phases"].items():
            if k != "detection":
                phases[k] = phases.get(k, 0.0) + v
    detect = row.detect or 0.0
    row.restart = last["fault_time"] + last["seconds"] - fault.time - detect
    phases["refuted"] = row.restart - sum(phases.values())
    ran = [e.step for e in evs if e.kind == ev.Kind.STEP_DONE and e.rank == 0
           and first["fault_time"] < e.time < last["fault_time"]]  # fmt: skip
    done = max(e.step for e in evs if e.kind == ev.Kind.STEP_DONE and e.rank == 0
               and e.step is not None and e.time <= fault.time + detect)  # fmt: skip
    row.fault, row.phases = "proof_failed", phases
    row.redo = len(ran) + done + 1 - int(last["proof"]["step"])
    row.proof = last["proof"].get("proof_steps")
    return [row]


def killed(repeats: int, nvrx: str = "") -> list[Row]:
    """The same killed rank under steadfast launch, torchrun and (``nvrx``: its
    environment's python) NVRx's ``ft_launcher``, median of ``repeats``."""
    launchers = {
        "steadfast": [sys.executable, "-m", "steadfast.cli", "launch",
                      "--ft-param-rank_section_timeouts=step:5"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }  # fmt: skip
    if nvrx:
        launchers["nvrx"] = [nvrx, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"]
    got: dict[str, list[float]] = {name: [] for name in launchers}
    for _ in range(repeats):  # interleaved
        for name, cmd in launchers.items():
            back = bench_launcher.run(cmd, kill=True)[1]
            assert back is not None
            got[name].append(back)
    return [
        Row("rank_killed", name, 0.0, statistics.median(v), source=f"_restart_worker.py x{repeats}")
        for name, v in got.items()
    ]


HANG_WORKER = Path(__file__).with_name("_hang_worker.py")


def hung(repeats: int, nvrx: str = "") -> list[Row]:
    """The same hung rank (``_hang_worker.py``: NVRx's heartbeat pattern, timeouts
    calculated from the steps seen) under steadfast launch and (``nvrx``) NVRx's
    ``ft_launcher``, each at its defaults; median of ``repeats``. ``detect``: the hang to
    the hung rank's end (the launcher's detection and its stop), ``restart``: that to
    the first step after the restart."""
    launchers = {"steadfast": [sys.executable, "-m", "steadfast.cli", "launch"]}
    if nvrx:
        launchers["nvrx"] = [nvrx, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"]
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in launchers}
    for _ in range(repeats):  # interleaved
        for name, cmd in launchers.items():
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "steps")
                env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                           STEADFAST_EVENTS="off")  # fmt: skip
                subprocess.run(
                    [*cmd, "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
                     str(HANG_WORKER), out],
                    env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    timeout=600,
                )  # fmt: skip
                lines = [ln.split() for r in ("rank0", "rank1", "dead")
                         for ln in Path(f"{out}.{r}").read_text().splitlines()]  # fmt: skip
                hang = min(float(t) for g, _, t in lines if g == "hang")
                dead = min(float(t) for g, _, t in lines if g == "dead")
                back = min(float(t) for g, _, t in lines if g == "1")
                got[name].append((dead - hang, back - dead))
    return [
        Row("rank_hung", name, statistics.median(d for d, _ in v),
            statistics.median(r for _, r in v), source=f"_hang_worker.py x{repeats}")
        for name, v in got.items()
    ]  # fmt: skip


def import_torch(repeats: int = 3) -> float:
    """A bare ``python -c "import torch"``, the median of ``repeats``: the requeue's
    baseline (everything of a requeue beyond it is the launcher's and the library's)."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=300)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def nodes(nvrx: str = "") -> list[Row]:
    """A lost node with a spare and without one, on the network-namespace bed; with
    ``nvrx``, also NVRx's ``ft_launcher`` with a spare (and torchrun beside it) on a
    script that imports nothing of steadfast."""
    check = subprocess.run(["bash", str(bench_node_loss.SCRIPT), "check"], capture_output=True)
    if check.returncode != 0:
        print("  nodes: skipped (no network namespaces here: needs root)")
        return []
    rows = []
    cases = [
        ("lost_node", "steadfast", "steadfast", True, "spare, steadfast's rendezvous"),
        ("lost_node", "steadfast", "c10d", True, "spare, c10d under steadfast launch"),
        ("lost_node", "torchrun", "c10d", True, "spare, torchrun (c10d)"),
        ("lost_node_no_spare", "steadfast", "steadfast", False, "--nnodes 1:2, steadfast"),
        ("lost_node_no_spare", "torchrun", "c10d", False, "--nnodes 1:2, torchrun (c10d)"),
    ]
    for fault, launcher, backend, spare, source in cases:
        rec = bench_node_loss.run(launcher, False, backend, spare=spare)
        phases = {k: v for k, v in (rec.phases or {}).items() if k != "detection"}
        detect = rec.detected
        # torchrun's detection is not told apart: its restart is the kill to the first step
        restart = rec.first_step - (detect or 0.0)
        system = f"{launcher}/{backend}" if launcher == "steadfast" else launcher
        if detect is None:
            source += "; restart: the kill to the first step"
        rows.append(Row(fault, system, detect, restart, phases, source=source))
    if nvrx:  # NVRx's environment has no steadfast: the unchanged script, both launchers
        unchanged = {
            "nvrx": [nvrx, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"],
            "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        }
        for system, cmd in unchanged.items():
            back = bench_node_loss.run_unchanged(cmd)
            rows.append(Row("lost_node", system, None, back, source="spare, unchanged_train.py "
                            "(its own snapshot); restart: the kill to the first step"))  # fmt: skip
    return rows


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[Row]) -> str:
    head = ["fault", "system", "detect", *COLUMNS, "restart", "redo", "proof"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.fault, r.system, _fmt(r.detect), *(_fmt(r.column(c)) for c in COLUMNS),
                 _fmt(r.restart), "-" if r.redo is None else str(r.redo),
                 "-" if r.proof is None else str(r.proof)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The projection's fault kinds, and the row of the table that measures each.
PROJECTED = {"crash": "rank_killed", "hang": "rank_hung", "lost_node": "lost_node",
             "proof_failed": "proof_failed"}  # fmt: skip


def costs(rows: list[Row]) -> dict[str, Any]:
    """The projection's input (bench_goodput_projection.py's MEASURED shape): each
    system's measured rows where this run has them (a crash: the same killed worker under
    each launcher), its assumed costs, with their source, where not."""
    from bench_goodput_projection import MEASURED

    out: dict[str, Any] = json.loads(json.dumps(MEASURED))
    for system, kinds in out.items():
        for kind, row_fault in PROJECTED.items():
            if kinds[kind]["restart"] is None:  # the model's: no recovery in the job
                continue
            mine = [r for r in rows if r.fault == row_fault and r.system.split("/")[0] == system
                    and r.restart is not None]  # fmt: skip
            preferred = {"crash": "_restart_worker", "lost_node": "spare, steadfast's"}
            mine = [r for r in mine if r.source.startswith(preferred.get(kind, ""))] or mine
            if not mine:
                kinds[kind]["source"] = (
                    f"assumed, not measured in this run: {kinds[kind]['source']}"
                )
                continue
            r = mine[0]
            kinds[kind]["restart"] = round(r.restart or 0.0, 3)
            if kinds[kind]["detect"] is not None:  # None: the model's learned timeout
                kinds[kind]["detect"] = round(r.detect or 0.0, 3)
            kinds[kind]["source"] = f"bench_fault_costs: {r.source}"
    proofs = [r.proof for r in rows if r.system == "steadfast" and r.proof is not None]
    return {
        "systems": out,
        "proof_steps": statistics.mean(proofs) if proofs else None,
        "table": [asdict(r) for r in rows],
    }


def predicted(rows: list[Row], parts: dict[str, Any]) -> float:
    """The demo's goodput as the table predicts it: its productive time over that time
    plus the first launch's cold start, what its healthy steps lost (the blocking part of
    its saves, the straggling, its end, the rest: as measured) and each of its faults'
    cost from the table (detection, restart, the steps done again; a slowed rank's cost is its
    straggling)."""
    lost = 0.0
    for r in rows:
        if r.source == "steadfast demo" and r.fault != "slow_rank":
            lost += (r.detect or 0.0) + (r.restart or 0.0) + (r.redo or 0.0) * (r.step_s or 0.0)
    healthy = sum(parts["badput"].get(k, 0.0)
                  for k in ("checkpoint_save", "straggling", "teardown", "other"))  # fmt: skip
    prod = parts["productive"]
    return float(prod / (prod + parts["cold_start"] + healthy + lost))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("fault_costs.json"))
    ap.add_argument("--skip", default="", help="comma-separated jobs to leave out")
    ap.add_argument("--repeats", type=int, default=3, help="of the killed-rank runs")
    ap.add_argument("--nvrx", default="", help="NVRx's python (NVRX_WHEEL=0.4.1 "
                    "scripts/nvrx-env.sh .nvrx-0.4.1 makes it): its killed-rank row")  # fmt: skip
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rows: list[Row] = []
    parts: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "demo" not in skip:
            print("demo ...", flush=True)
            demo_rows, parts = demo(work)
            rows += demo_rows
        if "frozen" not in skip:
            print("frozen rank ...", flush=True)
            rows += frozen(work)
        if "proof" not in skip:
            print("failed proof ...", flush=True)
            rows += proof(work)
    if "kill" not in skip:
        print("killed rank, steadfast and torchrun ...", flush=True)
        rows += killed(args.repeats, args.nvrx)
    if "hang" not in skip:
        print("hung rank, steadfast and NVRx ...", flush=True)
        rows += hung(args.repeats, args.nvrx)
    print("a bare import torch ...", flush=True)
    bare_import = import_torch()
    failed = None  # a job that did not recover: the others' rows are still printed
    if "nodes" not in skip:
        print("lost nodes ...", flush=True)
        try:
            rows += nodes(args.nvrx)
        except SystemExit as exc:
            failed = f"lost nodes: not measured, {exc}"
    print()
    print(table(rows))
    for r in rows:
        print(f"  {r.fault} / {r.system}: {r.source}; phases "
              + ", ".join(f"{k} {v:.3f}" for k, v in r.phases.items() if v >= 0.0005)
              + (f"; {r.kept} steps done after the signal, kept (not in its stop)"
                 if r.kept else ""))  # fmt: skip
    if parts is not None:
        print(
            f"\nthe demo: goodput measured {100 * parts['goodput']:.1f} %, predicted from its "
            f"rows {100 * predicted(rows, parts):.1f} % (badput measured: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in parts["badput"].items())
            + ")"
        )
    requeue = [r for r in rows if r.fault == "sigterm" and r.restart is not None]
    print(f"\na bare `python -c 'import torch'`: {bare_import:.2f} s (median of 3)")
    if requeue:
        back = requeue[0].restart or 0.0
        print(f"the requeue, the signal to the first step less the steps kept: {back:.2f} s, "
              f"{back / bare_import:.2f}x the bare import (goal: 1.5x)")  # fmt: skip
    out = costs(rows)
    out["import_torch"] = round(bare_import, 3)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written: {args.out} (bench/bench_goodput_projection.py --costs {args.out})")
    if failed:
        raise SystemExit(failed)


if __name__ == "__main__":
    main()
