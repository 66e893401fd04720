"""The control plane at scale, simulated (issue 28): N nodes' rendezvous handlers, no
training workers, against a real ``TCPStore`` (``sfsim``; the nodes spread over
worker processes), side by side in the same run: torch's dynamic rendezvous (c10d
backend), steadfast's own, and, with ``--nvrx PYTHON`` (the environment
``scripts/nvrx-env.sh`` makes), NVRx's barrier rendezvous from its newest source; with
``--etcd HOST:PORT,...`` torch's also runs on an etcd cluster's v2 API (its etcd-v2
backend) and steadfast's on its v3 API.

Per design and N it prints:
- machine-independent figures, counted at the store client: operations and bytes per
  node for the join (median node, and the node that moved most), and per node per
  keep-alive interval once the round runs (the keep-alive and the agent's
  ``num_nodes_waiting`` every 0.1 s);
- this machine's: the time for N nodes to join, resident memory per simulated node, a
  bare store operation's latency (us/op) and what the counting proxy adds to it (the
  harness's overhead);
then a node lost after the round formed while a spare waits: one survivor reports it as
its launcher does when its ring sees the loss (expiry; NVRx: it opens the next round),
and every survivor and the spare join the next round: the time, and the store
operations and bytes per node. Then a power law
fitted to each figure (log-log least squares over the measured N) and its value at
4,096, 8,192 and 16,384 nodes; the timings assume this machine's store latency (a
loopback ``TCPStore``, one server thread, printed), the counts assume nothing. Then
the node roster (``sfsim.roster``): N real rosters enter a round and one is
killed: store operations per node to enter, and messages per loss detection.

    .venv/bin/python bench/bench_control_plane.py [--nodes 16 64 256 1024 2048]
        [--torch-nodes 16 64] [--nvrx .nvrx/venv/bin/python] [--nvrx-nodes 16 64 256]
        [--etcd 127.0.0.1:2379] [--roster-nodes 16 64 256]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from sfsim import Loss, Run, simulate_join, simulate_loss
from sfsim.roster import simulate_roster

EXTRAPOLATE = (4096, 8192, 16384)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a * x**b``, least squares on the logarithms."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-12)) for y in ys]
    n = len(lx)
    mx, my = sum(lx) / n, sum(ly) / n
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / max(
        1e-12, sum((x - mx) ** 2 for x in lx)
    )
    return math.exp(my - b * mx), b


def joins(design: str, nodes: list[int], args: argparse.Namespace, **on: Any) -> list[Run]:
    runs: list[Run] = []
    where = " on etcd" if on.get("etcd") else ""
    print(f"\n{design}{where}: the join, then the round running (per node: the median node)")
    head = f"{'N':>6} {'procs':>5} {'join s':>8} {'join ops':>9} {'join KB':>9} {'max KB':>9} "
    head += f"{'ka ops':>7} {'ka KB':>9} {'store MB/ka':>12} {'KB/node':>8} "
    print(head + f"{'us/op':>6} {'+proxy':>6}")
    for n in nodes:
        try:
            run = simulate_join(n, design, keep_alive=args.keep_alive, window=args.window, **on)
        except RuntimeError as exc:  # the rendezvous did not form the round in time
            print(f"{n:>6} no round formed: {exc}", flush=True)
            break
        runs.append(run)
        total = run.keep_alive.bytes * n / 1e6
        print(f"{n:>6} {run.processes:>5} {run.join_seconds:>8.2f} {run.join.count:>9} "
              f"{run.join.bytes / 1e3:>9.2f} "
              f"{run.join_max.bytes / 1e3:>9.1f} {run.keep_alive_ops:>7.1f} "
              f"{run.keep_alive.bytes / 1e3:>9.3f} {total:>12.3f} "
              f"{run.memory_per_node / 1e3:>8.0f} {run.latency_per_op * 1e6:>6.0f} "
              f"{run.overhead_per_op * 1e6:>6.1f}",
              flush=True)  # fmt: skip
    return runs


def losses(design: str, nodes: list[int], args: argparse.Namespace, **on: Any) -> list[Loss]:
    found: list[Loss] = []
    where = " on etcd" if on.get("etcd") else ""
    print(
        f"\n{design}{where}: a node lost while a spare waits; the survivors and the spare re-form"
    )
    print(f"{'N':>6} {'last call s':>11} {'loss->round s':>13} {'expire ops':>10} "
          f"{'round ops':>9} {'round KB':>9} {'max KB':>9}")  # fmt: skip
    for n in nodes:
        try:
            loss = simulate_loss(n, design, last_call=args.last_call, **on)
        except RuntimeError as exc:
            print(f"{n:>6} no round formed: {exc}", flush=True)
            break
        found.append(loss)
        print(f"{n:>6} {loss.last_call:>11.1f} {loss.seconds:>13.2f} {loss.expire.count:>10} "
              f"{loss.round.count:>9} {loss.round.bytes / 1e3:>9.2f} "
              f"{loss.round_max.bytes / 1e3:>9.1f}", flush=True)  # fmt: skip
    return found


def extrapolate(design: str, runs: list[Run], lost: list[Loss], where: str = "") -> None:
    if len(runs) < 2:
        return
    xs = [float(r.nodes) for r in runs]
    figures = {
        "join seconds": [r.join_seconds for r in runs],
        "join ops per node": [float(r.join.count) for r in runs],
        "join bytes per node": [float(r.join.bytes) for r in runs],
        "keep-alive bytes per node per interval": [float(r.keep_alive.bytes) for r in runs],
        "keep-alive store bytes per interval (all nodes)": [
            float(r.keep_alive.bytes * r.nodes) for r in runs
        ],
    }
    if len(lost) == len(runs):
        figures["node lost -> next round, seconds"] = [loss.seconds for loss in lost]
        figures["next round ops per node"] = [float(loss.round.count) for loss in lost]
        figures["next round bytes per node"] = [float(loss.round.bytes) for loss in lost]
    print(f"\n{design}{where}: fitted y = a * N^b, and extrapolated:")
    print(f"{'figure':<48} {'b':>5} " + " ".join(f"{n:>12}" for n in EXTRAPOLATE))
    for name, ys in figures.items():
        if not any(ys):
            print(f"{name:<48} {'-':>5} " + " ".join(f"{0:>12}" for _ in EXTRAPOLATE))
            continue
        a, b = fit(xs, ys)
        print(f"{name:<48} {b:>5.2f} " + " ".join(f"{a * n**b:>12.3g}" for n in EXTRAPOLATE))


def rosters(nodes: list[int]) -> None:
    print("\nthe node roster: N rosters enter a round (ring watch), one is killed")
    print(f"{'N':>6} {'enter s':>8} {'enter ops':>9} {'enter KB':>9} {'rank0 KB':>9} "
          f"{'fence ops':>9} {'fence B':>7} {'bye ops':>7} "
          f"{'detect s':>8} {'loss ops':>8} {'loss KB':>8} {'ring B/node/s':>13}")  # fmt: skip
    for n in nodes:
        r = simulate_roster(n)
        print(f"{n:>6} {r.enter_seconds:>8.2f} {r.enter.count:>9} {r.enter.bytes / 1e3:>9.2f} "
              f"{r.enter_max.bytes / 1e3:>9.1f} {r.fence.count:>9} {r.fence.bytes:>7} "
              f"{r.goodbye_ops:>7} {r.detect_seconds:>8.2f} {r.loss_ops:>8} "
              f"{r.loss_bytes / 1e3:>8.2f} {r.ring_bytes_per_node_second:>13.1f}",
              flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="*", default=[16, 64, 256, 1024, 2048])
    ap.add_argument("--torch-nodes", type=int, nargs="*", default=[16, 64],
                    help="N for torch's rendezvous (it forms no 256-node round here)")  # fmt: skip
    ap.add_argument("--roster-nodes", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--nvrx", default="", help="the python of scripts/nvrx-env.sh's environment")
    ap.add_argument("--nvrx-nodes", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--etcd", default="", help="an etcd cluster's client endpoints, a,b,c")
    ap.add_argument("--etcd-nodes", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--window", type=float, default=10.0, help="seconds of the round running")
    ap.add_argument("--keep-alive", type=float, default=5.0, help="keep-alive interval (s)")
    ap.add_argument("--last-call", type=float, default=1.0, help="the rendezvous' last call")
    args = ap.parse_args()
    plan: list[tuple[str, list[int], dict[str, Any]]] = [
        ("torch", args.torch_nodes, {}),
        ("steadfast", args.nodes, {}),
    ]
    if args.nvrx:
        plan.append(("nvrx", args.nvrx_nodes, {"python": args.nvrx}))
    if args.etcd:  # torch's etcd-v2 (the v2 API: etcd --enable-v2) and steadfast's (v3)
        on_etcd = {"etcd": tuple(args.etcd.split(","))}
        plan.append(("torch", args.torch_nodes, on_etcd))
        plan.append(("steadfast", args.etcd_nodes, on_etcd))
    for design, nodes, on in plan:
        if not nodes:
            continue
        runs = joins(design, nodes, args, **on)
        lost = losses(design, [r.nodes for r in runs], args, **on)
        extrapolate(design, runs, lost, " on etcd" if on.get("etcd") else "")
    if args.roster_nodes:
        rosters(args.roster_nodes)


if __name__ == "__main__":
    main()
