"""The control plane at scale, simulated (issue 28): N nodes' rendezvous handlers in one
process, no training workers, against a real ``TCPStore`` (``steadfast.sim``).

For torch's dynamic rendezvous (c10d backend, as ``steadfast launch`` uses it today) it
prints, per N:
- machine-independent figures, counted at the store client: operations and bytes per
  node for the join (median node, and the node that sent most), and per node per
  keep-alive interval once the round has formed;
- this machine's: the time for N nodes to join, resident memory per simulated node, a
  bare store operation's latency (us/op) and what the counting proxy adds to it (the
  harness's overhead);
then a power law fitted to each figure (log-log least squares over the measured N) and
its value at 4,096, 8,192 and 16,384 nodes. Then a node lost after the round formed
(an elastic range N-1..N): one survivor expires it, as the launcher does when its ring
reports the loss, and every survivor joins the next round: the time, and the store
operations and bytes per survivor. The timings assume this machine's store
latency (a loopback ``TCPStore``, one server thread); the counts assume nothing.

    .venv/bin/python bench/bench_control_plane.py [--nodes 16 64 256 1024] [--window 3]
"""

from __future__ import annotations

import argparse
import math

from steadfast.sim import Loss, Run, simulate_dynamic, simulate_loss

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--window", type=float, default=10.0, help="seconds of keep-alives")
    ap.add_argument("--keep-alive", type=float, default=5.0, help="keep-alive interval (s)")
    ap.add_argument("--last-call", type=float, default=1.0, help="the rendezvous' last call")
    args = ap.parse_args()
    runs: list[Run] = []
    print("torch dynamic rendezvous, c10d backend on a TCPStore (per node: median node)")
    head = f"{'N':>6} {'join s':>8} {'join ops':>9} {'join KB':>9} {'max KB':>9} "
    head += f"{'ka ops':>7} {'ka KB':>9} {'store MB/ka':>12} {'KB/node':>8} "
    print(head + f"{'us/op':>6} {'+proxy':>6}")
    for n in args.nodes:
        try:
            run = simulate_dynamic(n, keep_alive=args.keep_alive, window=args.window)
        except RuntimeError as exc:  # torch's rendezvous did not form the round in time
            print(f"{n:>6} no round formed: {exc}", flush=True)
            break
        runs.append(run)
        total = run.keep_alive.bytes * n / 1e6
        print(f"{n:>6} {run.join_seconds:>8.2f} {run.join.count:>9} {run.join.bytes / 1e3:>9.1f} "
              f"{run.join_max.bytes / 1e3:>9.1f} {run.keep_alive.count:>7} "
              f"{run.keep_alive.bytes / 1e3:>9.1f} {total:>12.2f} "
              f"{run.memory_per_node / 1e3:>8.0f} {run.latency_per_op * 1e6:>6.0f} "
              f"{run.overhead_per_op * 1e6:>6.1f}",
              flush=True)  # fmt: skip
    print("\na node lost: one survivor expires it, every survivor joins the next round")
    print(f"{'N':>6} {'last call s':>11} {'loss->round s':>13} {'expire ops':>10} "
          f"{'round ops':>9} {'round KB':>9} {'max KB':>9}")  # fmt: skip
    losses: list[Loss] = []
    for n in [r.nodes for r in runs]:
        try:
            loss = simulate_loss(n, last_call=args.last_call)
        except RuntimeError as exc:
            print(f"{n:>6} no round formed: {exc}", flush=True)
            break
        losses.append(loss)
        print(f"{n:>6} {loss.last_call:>11.1f} {loss.seconds:>13.2f} {loss.expire.count:>10} "
              f"{loss.round.count:>9} {loss.round.bytes / 1e3:>9.1f} "
              f"{loss.round_max.bytes / 1e3:>9.1f}", flush=True)  # fmt: skip
    if len(runs) < 2:
        return
    xs = [float(r.nodes) for r in runs]
    figures = {
        "join seconds": [r.join_seconds for r in runs],
        "join bytes per node": [float(r.join.bytes) for r in runs],
        "keep-alive bytes per node per interval": [float(r.keep_alive.bytes) for r in runs],
        "keep-alive store bytes per interval (all nodes)": [
            float(r.keep_alive.bytes * r.nodes) for r in runs
        ],
    }
    if len(losses) == len(runs):
        figures["node lost -> next round, seconds"] = [loss.seconds for loss in losses]
        figures["next round bytes per node"] = [float(loss.round.bytes) for loss in losses]
    print("\nfitted y = a * N^b, and extrapolated:")
    print(f"{'figure':<48} {'b':>5} " + " ".join(f"{n:>12}" for n in EXTRAPOLATE))
    for name, ys in figures.items():
        a, b = fit(xs, ys)
        print(f"{name:<48} {b:>5.2f} " + " ".join(f"{a * n**b:>12.3g}" for n in EXTRAPOLATE))


if __name__ == "__main__":
    main()
