"""A lost node's way back, steadfast vs plain torchrun, on nodes made of network
namespaces (scripts/nodes-localhost.sh; needs root):

    .venv/bin/python bench/bench_node_loss.py [--repeats 1] [--silent] [--rdzv-backend steadfast]

Two nodes of one rank each train tests/e2e/ft_train.py (c10d rendezvous on node1, a
checkpoint every 2 steps); a spare node3 waits (started 10 s before); node2 is killed
at once (every process of its PID namespace; ``--silent``: its link goes down first, so
no peer sees a reset).

- detection: the kill -> the ``node_lost`` event (steadfast; torchrun has none);
- first step: the kill -> every rank of the new round (node1 and the spare) finished its
  first step, split into detection, rendezvous (-> ``node_joined``), worker start (->
  the checkpoint load begins: fork, process group), checkpoint load, and the step.

torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as in bench_launcher.py (its
gloo restarts fail on torch 2.13 without it), and the same script without the rank
monitor (--no-ft). It finds the lost node only when its rendezvous keep-alive expires.
``--rdzv-backend steadfast``: steadfast launches with its own rendezvous (torchrun keeps
c10d, the one it has).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "nodes-localhost.sh"
TRAIN = REPO / "tests" / "e2e" / "ft_train.py"
#: A torchrun script that imports nothing of steadfast: what runs under NVRx's launcher,
#: whose environment has no steadfast.
UNCHANGED = REPO / "tests" / "e2e" / "unchanged_train.py"
#: Seconds from starting the spare's launcher to killing node2: a spare is a launcher that
#: has been waiting in the rendezvous, not one still importing torch.
SPARE_READY = 10.0


def bed(*args: str) -> None:
    subprocess.run(["bash", str(SCRIPT), *args], check=True, capture_output=True, timeout=120)


def events(path: Path) -> list[dict]:
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):  # a line being written
            found.append(json.loads(line))
    return found


def wait(path: Path, kind: str, step: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not any(e["kind"] == kind and e.get("step") == step for e in events(path)):
        if time.monotonic() > end:
            raise SystemExit(f"no {kind} of step {step} in {timeout} s")
        time.sleep(0.05)


@dataclass
class Recovery:
    """Seconds after the kill (None: that launcher has no such event)."""

    detected: float | None
    joined: float | None
    load_began: float
    loaded: float
    first_step: float
    phases: dict[str, float] | None = None  # steadfast report's, the restart's


def run(launcher: str, silent: bool, backend: str = "c10d", spare: bool = True) -> Recovery:
    """One run of ``launcher`` on a fresh bed: node2 killed, the spare takes over (without
    ``spare``: ``--nnodes 1:2``, node1 goes on alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "bed"
        bed("up", str(root), "3" if spare else "2")
        try:
            shared = root / "shared"
            log, steps = shared / "events.jsonl", shared / "steps.log"
            flags = [
                "--nnodes=2" if spare else "--nnodes=1:2", "--nproc-per-node=1",
                "--rdzv-endpoint=node1:29500", "--rdzv-id=bench", "--max-restarts=3",
                "--monitor-interval=0.1",
            ]  # fmt: skip
            if not spare:  # the survivor's round closes 1 s after it alone is back
                flags += ["--rdzv-conf=last_call_timeout=1"]
            if launcher == "steadfast":
                cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--events", str(log)]
                flags += [f"--rdzv-backend={backend}", "--ft-node-heartbeat-timeout=2"]
                extra: list[str] = []
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run"]
                flags += ["--rdzv-backend=c10d"]
                extra = ["--no-ft"]
            script = [
                str(TRAIN), "--ckpt", str(shared / "ck"), "--out", str(shared / "out.pt"),
                "--steps", "240", "--step-sleep", "0.1", "--step-log", str(steps), *extra,
            ]  # fmt: skip
            env = dict(
                os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", STEADFAST_EVENTS=str(log)
            )

            def start(node: str) -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    ["bash", str(SCRIPT), "run", str(root), node, *cmd, *flags, *script],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )

            procs = [start("node1"), start("node2")]
            wait(log, "checkpoint_saved", 4)
            while not any(line.split()[0] == "1" for line in steps.read_text().splitlines()):
                time.sleep(0.05)  # node2 trains (an elastic round may have closed without it)
            if spare:
                procs.append(start("node3"))
                time.sleep(SPARE_READY)  # the spare's launcher waits in the rendezvous
            saved = [e["step"] for e in events(log) if e["kind"] == "checkpoint_saved"]
            wait(log, "checkpoint_saved", max(saved) + 2)
            killed = time.time()
            bed("kill", str(root), "node2", *(["--silent"] if silent else []))
            for proc in procs:
                proc.wait(300)
            if procs[0].returncode != 0 or (spare and procs[2].returncode != 0):
                kept = Path(tempfile.gettempdir()) / f"bench_node_loss_{launcher}_{backend}.jsonl"
                shutil.copy(log, kept)  # the bed's folder goes with it
                codes = [p.returncode for p in procs]
                raise SystemExit(
                    f"{launcher}: the run did not recover (launchers' exits {codes}); "
                    f"its events: {kept}"
                )
            after = [e for e in events(log) if e["time"] > killed]

            def first(kind: str) -> float | None:
                times = [e["time"] - killed for e in after if e["kind"] == kind]
                return min(times) if times else None

            loads = [e for e in after if e["kind"] == "checkpoint_loaded"]
            loaded = max(e["time"] for e in loads)
            done: dict[str, float] = {}  # rank -> end of its first step after the load
            for line in steps.read_text().splitlines():
                rank, _, at = line.split()
                if float(at) > loaded and rank not in done:
                    done[rank] = float(at)
            phases = None
            if launcher == "steadfast":
                rep = subprocess.run(
                    [sys.executable, "-m", "steadfast.cli", "report", "--json", "--no-timeline",
                     str(log)], capture_output=True, text=True, check=True, timeout=120,
                )  # fmt: skip
                restarts = json.loads(rep.stdout)["restarts_phases"]
                phases = restarts[-1]["phases"] if restarts else None
            return Recovery(
                phases=phases,
                detected=first("node_lost"),
                joined=first("node_joined"),
                load_began=min(e["time"] - e["seconds"] for e in loads) - killed,
                loaded=loaded - killed,
                first_step=max(done.values()) - killed,
            )
        finally:
            bed("down", str(root))


def _trace_steps(path: Path) -> list[tuple[int, float]]:
    """``unchanged_train.py``'s trace: (steps done, when) for each step line."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(w[1]), float(w[2])) for w in (ln.split() for ln in lines) if w[0] == "step"]


def run_unchanged(launcher: list[str]) -> float:
    """A launcher that runs scripts importing nothing of steadfast (NVRx's
    ``ft_launcher``, from its own environment) on a fresh bed: node1 and node2 train
    ``unchanged_train.py`` (its own snapshot every 2 steps), a spare node3 waits, node2 is
    killed right after a snapshot. Returns the kill -> the first step of the new round:
    the spare's first step, which DDP makes together with node1's."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "bed"
        bed("up", str(root), "3")
        procs: list[subprocess.Popen[bytes]] = []
        try:
            shared = root / "shared"
            flags = [
                "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                "--rdzv-endpoint=node1:29500", "--rdzv-id=bench", "--max-restarts=3",
                "--monitor-interval=0.1",
            ]  # fmt: skip
            env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

            def start(node: str) -> subprocess.Popen[bytes]:
                script = [
                    str(UNCHANGED), "--out", str(shared / "out.pt"),
                    "--snapshot", str(shared / "snap.pt"), "--trace", str(shared / node),
                    "--steps", "240", "--pace", "0.1", "--snapshot-every", "2",
                ]  # fmt: skip
                return subprocess.Popen(
                    ["bash", str(SCRIPT), "run", str(root), node, *launcher, *flags, *script],
                    env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip

            def until(ready: Callable[[], bool], what: str, pause: float) -> None:
                end = time.monotonic() + 120
                while not ready():
                    if time.monotonic() > end:
                        raise SystemExit(f"the unchanged job on the bed: no {what} in 120 s")
                    time.sleep(pause)

            procs += [start("node1"), start("node2")]
            until(lambda: len(_trace_steps(shared / "node2")) >= 4, "step on node2", 0.05)
            procs.append(start("node3"))
            time.sleep(SPARE_READY)  # the spare's launcher waits in the rendezvous
            seen = len(_trace_steps(shared / "node1"))

            def after_a_snapshot() -> bool:  # the step lines that follow one
                steps = _trace_steps(shared / "node1")
                return len(steps) > seen and steps[-1][0] % 2 == 0

            until(after_a_snapshot, "snapshot after the spare's start", 0.005)
            killed = time.time()
            bed("kill", str(root), "node2")
            for proc in (procs[0], procs[2]):
                proc.wait(300)
            codes = [p.returncode for p in procs]
            spare = _trace_steps(shared / "node3")
            if codes[0] != 0 or codes[2] != 0 or not spare:
                raise SystemExit(f"{launcher[0]}: the run did not recover (exits {codes})")
            return spare[0][1] - killed
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            bed("down", str(root))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--silent", action="store_true")
    ap.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "steadfast"])
    args = ap.parse_args()
    if subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True).returncode != 0:
        print("bench_node_loss: skipped (cannot make nodes here: needs root and netns)")
        return
    results = {
        name: [run(name, args.silent, args.rdzv_backend) for _ in range(args.repeats)]
        for name in ("steadfast", "torchrun")
    }
    how = "silent kill" if args.silent else "kill"

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    for name, runs in results.items():
        for r in runs:
            if r.phases is not None:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in r.phases.items() if v >= 0.0005)
                print(f"  {name} restart phases (steadfast report): {parts}")
        first = med([r.first_step for r in runs])
        detected, joined = med([r.detected for r in runs]), med([r.joined for r in runs])
        began, loaded = med([r.load_began for r in runs]), med([r.loaded for r in runs])
        assert first is not None and began is not None and loaded is not None
        rdzv = args.rdzv_backend if name == "steadfast" else "c10d"
        print(
            f"{name} ({rdzv} rendezvous): node2 {how} -> first step of the new round "
            f"{first:.2f} s (median of {len(runs)})"
        )
        if detected is not None and joined is not None:
            print(
                f"  detection {detected:.2f} s, rendezvous {joined - detected:.2f} s, "
                f"worker start {began - joined:.2f} s, checkpoint load {loaded - began:.2f} s, "
                f"first step {first - loaded:.2f} s"
            )
        else:
            print(
                f"  no node events; workers of the new round began loading at {began:.2f} s, "
                f"checkpoint load {loaded - began:.2f} s, first step {first - loaded:.2f} s"
            )
    ours = med([r.first_step for r in results["steadfast"]])
    theirs = med([r.first_step for r in results["torchrun"]])
    assert ours is not None and theirs is not None
    print(f"torchrun / steadfast (kill -> first step of the new round): {theirs / ours:.1f}x")


if __name__ == "__main__":
    main()
