"""Ends after restarts (issue 68): user scripts with one rank killed once mid-run, under
torchrun and ``steadfast launch`` in turn, counting for each launcher the exit codes,
the generations, the epochs trained again after the job's training had ended, and the
teardown warnings (``worker_teardown``).

    .venv/bin/python bench/bench_restart_ends.py [--runs 50] [--scripts tutorial,readme,loader]

The scripts (``bench/scripts/``): pytorch/examples' DDP tutorial (``ddp_tutorial.py``:
``main()`` holds the DDP model, calls ``destroy_process_group()`` and returns; its own
snapshot every 4 epochs, resumed after the restart), the README's first script's shape
(``readme_ddp.py``: DDP at module level, no snapshot: a restart trains from its start,
by the script's design) and a DDP script with DataLoader workers and an evaluation pass
(``loader_eval.py``). 2 gloo ranks on one host, torchrun's ``--rdzv-backend c10d``
command line, ``--max-restarts 3``. Each script prints a line per epoch
(``[GPUr] Epoch e``); once rank 1 printed epoch ``--kill-at`` the bench SIGKILLs it
(its pid from steadfast's event log, or for torchrun by its ``RANK=1`` among the
processes carrying this run's tag in their environment), once per run. A run is *bad*
when it did not exit 0 within the limit, or trained again an epoch after every rank had
printed the last one (a finished job trained again). The goal: 0 bad ends and 0 epochs
trained twice after the end, for steadfast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
EPOCH = re.compile(r"\[GPU(\d+)\] Epoch (\d+)")
TORCHRUN_RESTART = re.compile(r"attempts left")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SCRIPTS = {  # name: (file, its arguments, its last epoch)
    "tutorial": ("ddp_tutorial.py", ["12", "4", "--batch_size", "8"], 11),
    "readme": ("readme_ddp.py", ["12"], 11),
    "loader": ("loader_eval.py", ["12"], 11),
}


def _rank1(tag: str, log: Path) -> int | None:
    """The pid of the worker of global rank 1: under steadfast from its event log's last
    ``workers_started`` (a worker forked from the template shows the template's
    environment in ``/proc``), else among the processes carrying this run's tag."""
    if log.exists():
        for line in reversed(log.read_text().splitlines()):
            event = json.loads(line) if line.endswith("}") else {}
            if event.get("kind") == "workers_started":
                return int(dict(zip(event["ranks"], event["pids"], strict=True))[1])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"BENCH_RUN_TAG={tag}".encode() in env and b"RANK=1" in env:
            return int(entry)
    return None


def one(name: str, launcher: str, kill_at: int, limit: float) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix=f"ends-{name}-"))
    tag = uuid.uuid4().hex
    try:
        script, args, last = SCRIPTS[name]
        common = [
            "--nnodes=1",
            "--nproc-per-node=2",
            "--max-restarts=3",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{_port()}",
        ]
        target = [str(HERE / "scripts" / script), *args]
        if launcher == "torchrun":
            cmd = [str(BIN / "torchrun"), *common, *target]
        else:
            cmd = [
                str(BIN / "steadfast"),
                "launch",
                f"--run-dir={workdir / 'run'}",
                *common,
                *target,
            ]
        # LOGLEVEL=INFO: torchrun says each restart ("N/M attempts left")
        env = {**os.environ, "BENCH_RUN_TAG": tag, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}
        began = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        lines: list[str] = []
        killed = threading.Event()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                seen = [int(e) for r, e in EPOCH.findall(line) if r == "1"]
                if seen and not killed.is_set() and max(seen) >= kill_at:
                    pid = _rank1(tag, workdir / "run" / "events.jsonl")
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        killed.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        reader.join(5)
        took = time.monotonic() - began
        # epochs printed by every rank after each had printed the last one
        seen_last: set[str] = set()
        again = 0
        for line in lines:  # two ranks' lines may share a line
            for rank, epoch in EPOCH.findall(line):
                if seen_last >= {"0", "1"}:
                    again += 1
                if int(epoch) == last:
                    seen_last.add(rank)
        kinds: list[str] = []
        log = workdir / "run" / "events.jsonl"
        if log.exists():
            kinds = [json.loads(x)["kind"] for x in log.read_text().splitlines() if x]
        if launcher == "torchrun":
            generations = 1 + sum(bool(TORCHRUN_RESTART.search(x)) for x in lines)
        else:
            generations = kinds.count("workers_started")
        return {
            "code": code,
            "seconds": took,
            "killed": killed.is_set(),
            "generations": generations,
            "again": again,
            "teardowns": kinds.count("worker_teardown"),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--scripts", default="tutorial,readme,loader")
    parser.add_argument("--kill-at", type=int, default=6, help="rank 1's epoch killed at")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds a run may take")
    parser.add_argument("--launchers", default="torchrun,steadfast")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    bad_total = 0
    head = f"{'script':<9} {'launcher':<9} {'runs':>4} {'killed':>6} {'exit codes':<22} "
    print(head + f"{'generations':<14} {'bad end':>7} {'again':>5} {'teardown':>8} {'max s':>6}")
    for name in args.scripts.split(","):
        results: dict[str, list[dict[str, object]]] = {launcher: [] for launcher in launchers}
        for i in range(args.runs):  # interleaved: both see the same machine
            for launcher in launchers:
                results[launcher].append(one(name, launcher, args.kill_at, args.limit))
            print(f"  {name}: {i + 1}/{args.runs}", end="\r", file=sys.stderr, flush=True)
        for launcher, runs in results.items():
            codes: dict[str, int] = {}
            gens: dict[int, int] = {}
            for r in runs:
                key = "timeout" if r["code"] is None else str(r["code"])
                codes[key] = codes.get(key, 0) + 1
                gens[int(r["generations"])] = gens.get(int(r["generations"]), 0) + 1  # type: ignore[call-overload]
            bad = sum(1 for r in runs if r["code"] != 0 or int(r["again"]) > 0)  # type: ignore[call-overload]
            again = sum(int(r["again"]) for r in runs)  # type: ignore[call-overload]
            if launcher == "steadfast":
                bad_total += bad
            print(
                f"{name:<9} {launcher:<9} {len(runs):>4} {sum(bool(r['killed']) for r in runs):>6} "
                f"{' '.join(f'{k}:{v}' for k, v in sorted(codes.items())):<22} "
                f"{' '.join(f'{k}:{v}' for k, v in sorted(gens.items())):<14} {bad:>7} "
                f"{again:>5} {sum(int(r['teardowns']) for r in runs):>8} "  # type: ignore[call-overload]
                f"{max(float(r['seconds']) for r in runs):>6.1f}"  # type: ignore[arg-type]
            )
    print(f"steadfast runs that ended badly or trained a finished job again: {bad_total}")


if __name__ == "__main__":
    main()
