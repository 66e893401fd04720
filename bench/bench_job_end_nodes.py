"""Does every launcher end when a spare replaced a lost node, and how soon (issue 36)?

    .venv/bin/python bench/bench_job_end_nodes.py [--runs 20] [--cases c10d:before ...]
                                                   [--baseline-runs 3]

On the network-namespace bed (``scripts/nodes-localhost.sh``, root): 3 nodes and a spare,
one worker each, a plain torchrun script (``tests/multinode/plain_ddp.py``: DDP on gloo,
its own snapshot, no steadfast import), on every node the torchrun command line with
``steadfast launch`` in front: ``--nnodes 3 --nproc-per-node 1 --rdzv-backend B
--rdzv-endpoint node1:29500 --rdzv-id job --max-restarts 3``. The spare starts after
epoch 8 and node2 is killed 6 s later (``before``: the spare waits on the redundancy
list), or node2 is killed at epoch 8 and the spare starts once the loss is seen
(``after``). A case is ``BACKEND:ARRIVAL`` (c10d or steadfast; before or after).

Per run: whether every surviving launcher (the spare's included) ended with exit 0 within the cap
(150 s after the last epoch), their exit codes (node1, node3, node4), and the end lag:
from the last worker's exit (its ``done`` line, just before ``destroy_process_group``)
to the last launcher's exit as its parent saw it (polled every 50 ms). The baseline, in
the same run: plain ``torchrun`` (torch's elastic agent), c10d, the spare before the loss.
Target: every launcher ends, <= 1 s after the last worker's exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multinode"))
from conftest import SCRIPT, Bed  # noqa: E402  (the tests' bed, as they drive it)

PLAIN = REPO / "tests" / "multinode" / "plain_ddp.py"
EPOCHS, SLEEP, CAP = 40, 0.2, 150.0


def done_times(trace: Path) -> list[float]:
    return [
        float(line.split()[-1])
        for f in (trace.iterdir() if trace.exists() else [])
        for line in f.read_text().splitlines()
        if line.startswith("done")
    ]


def epoch_seen(trace: Path, epoch: int) -> bool:
    return any(
        line.startswith(f"epoch {epoch} ")
        for f in (trace.iterdir() if trace.exists() else [])
        for line in f.read_text().splitlines()
    )


def run_once(root: Path, backend: str, arrival: str, torchrun: bool) -> tuple[bool, float, str]:
    bed = Bed(root, 4)
    bed.up()
    bed.shared.mkdir(exist_ok=True)
    trace = bed.shared / "trace"
    flags = [
        "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", backend,
        "--rdzv-endpoint", "node1:29500", "--rdzv-id", "job", "--max-restarts", "3",
    ]  # fmt: skip
    args = [
        "--snapshot", str(bed.shared / "snapshot.pt"), "--epochs", str(EPOCHS),
        "--epoch-sleep", str(SLEEP), "--out", str(bed.shared / "out.pt"), "--trace", str(trace),
    ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ended: dict[str, float] = {}

    def start(node: str) -> None:
        if torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", *flags, str(PLAIN), *args]
            with (root / f"{node}.log").open("wb") as out:
                procs[node] = subprocess.Popen(
                    ["bash", str(SCRIPT), "run", str(root), node, *cmd],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                )  # fmt: skip
        else:
            procs[node] = bed.launch(node, *flags, script=args, program=PLAIN, own_log=True).proc

    def wait_epoch(epoch: int) -> None:
        end = time.monotonic() + 120
        while not epoch_seen(trace, epoch) and time.monotonic() < end:
            time.sleep(0.05)

    try:
        for n in ("node1", "node2", "node3"):
            start(n)
        wait_epoch(8)
        if arrival == "before":
            start("node4")
            time.sleep(6)
            bed.do("kill", "node2")
        else:
            bed.do("kill", "node2")
            time.sleep(2)  # the loss seen (node_heartbeat_timeout is well above a reset)
            start("node4")
        survivors = ["node1", "node3", "node4"]
        deadline = None
        while True:
            now = time.time()
            for n in survivors:
                if n not in ended and procs[n].poll() is not None:
                    ended[n] = now
            done = done_times(trace)
            if done and len(done) >= 3 and deadline is None:
                deadline = time.monotonic() + CAP
            if len(ended) == len(survivors) or (deadline and time.monotonic() > deadline):
                break
            time.sleep(0.05)
        codes = ",".join(str(procs[n].poll()) for n in survivors)
        ok = len(ended) == 3 and codes == "0,0,0"  # the job done: a lag to measure
        last_exit = max(done_times(trace) or [time.time()])
        return ok, (max(ended.values()) - last_exit) if ok else float("inf"), codes
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        bed.down()
        for p in procs.values():
            p.wait(30)


def summary(name: str, results: list[tuple[bool, float, str]]) -> float | None:
    lags = [lag for ok, lag, _ in results if ok]
    ended = len(lags)
    codes = sorted({c for _, _, c in results})
    line = f"{name:<34} every launcher ended with 0: {ended}/{len(results)} (exit codes {codes})"
    if lags:
        line += (
            f"   end lag median {statistics.median(lags):.2f} s, max {max(lags):.2f} s"
            f" (<= 1 s: {sum(1 for x in lags if x <= 1.0)}/{ended})"
        )
    print(line, flush=True)
    return statistics.median(lags) if lags else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each case")
    parser.add_argument(
        "--cases", nargs="*", default=["c10d:before", "c10d:after", "steadfast:before",
                                       "steadfast:after"],
    )  # fmt: skip
    parser.add_argument("--baseline-runs", type=int, default=3)
    parser.add_argument("--keep", help="keep every run's bed folder (logs, events) here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("the bed needs root (network namespaces)")
    medians: dict[str, float | None] = {}
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as d:
        runs = 0
        for case in args.cases:
            backend, arrival = case.split(":")
            results = []
            for _ in range(args.runs):
                runs += 1
                results.append(run_once(Path(d) / f"bed{runs}", backend, arrival, False))
            medians[case] = summary(f"steadfast launch {case}", results)
        base = [
            run_once(Path(d) / f"base{i}", "c10d", "before", True)
            for i in range(args.baseline_runs)
        ]
        baseline = summary("torchrun c10d:before (baseline)", base)
    if baseline is None and args.baseline_runs:
        print("torchrun did not end the job with exit 0 in any run: no baseline lag")
    if baseline:
        for case, median in medians.items():
            if median is not None:
                print(f"ratio {case}: {median / baseline:.2f} of torchrun's end lag")


if __name__ == "__main__":
    main()
