"""In-process restart latency: a fault on one rank -> every rank running the next iteration.

Two ranks (separate processes, gloo) train under ``steadfast.inprocess.Wrapper``. At step 5
of iteration 0, rank 1 faults while rank 0 is already blocked in the gradient all-reduce
waiting for it. Measured, per run: from the fault (rank 1's clock just before it raises
or kills itself) to the moment the *last* rank has re-entered the function in iteration
1 and finished its first all-reduce there (so the new process group is up).

Configurations, all measured in this run:
- ``steadfast``: the default ``AbortTorchDistributed``, with the process-group timeout
  at 5 s and at 60 s (the target: <= 0.5 s whatever the timeout);
- ``steadfast, SIGKILL``: rank 1 kills itself instead of raising (world 2 -> 1);
- ``NVRx's shape``: the group made on the user's own ``TCPStore`` (any port,
  ``multi_tenant``, libuv) through a ``PrefixStore`` per iteration, and held past the
  iteration's frames (as Megatron's parallel_state or DDP's reducer holds it), raise and
  SIGKILL at a 60 s timeout (before the fix these took the timeout: 60 s);
- baseline ``no abort``: the same Wrapper with ``abort=None``; the blocked rank is
  released only when its all-reduce times out (the behaviour measured for NVIDIA's
  Wrapper 0.4.1 on gloo: the timeout + 0.3 s), shown at 2 s and 5 s timeouts.

    .venv/bin/python bench/bench_inprocess.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

FAULT_STEP = 5
STEPS = 8


def worker(rank: int, mode: str, pg_timeout: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    from steadfast.inprocess import CallWrapper, Wrapper

    times: dict[str, Any] = {"entered": {}, "ready": {}}
    held: list[Any] = []  # NVRx's shape: the user's code keeps its groups
    td = timedelta
    abort: dict[str, Any] = {"abort": None} if mode == "noabort" else {}

    @Wrapper(
        soft_timeout=td(seconds=30),
        hard_timeout=td(seconds=60),
        barrier_timeout=td(seconds=120),
        monitor_process_logfile=None,
        **abort,
    )
    def train(cw: CallWrapper | None = None) -> None:
        assert cw is not None
        times["entered"][cw.iteration] = time.time()
        if dist.is_initialized():  # abort=None leaves the old group to the function
            dist.destroy_process_group()
        r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store: Any = cw.store
        if mode.startswith("nvrx"):
            user_store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]) + 7,
                world_size=w,
                is_master=r == 0,
                multi_tenant=True,
                wait_for_workers=True,
                use_libuv=True,
            )
            store = dist.PrefixStore(f"pg_iter{cw.iteration}", user_store)
        dist.init_process_group(
            "gloo", store=store, rank=r, world_size=w, timeout=td(seconds=pg_timeout)
        )
        if mode.startswith("nvrx"):
            held[:] = [dist.group.WORLD]
        grad = torch.ones(1000)
        for step in range(STEPS):
            if cw.iteration == 0 and step == FAULT_STEP and rank == 1:
                time.sleep(0.2)  # rank 0 is inside the all-reduce by now
                times["fault"] = time.time()
                Path(out).with_suffix(".fault").write_text(str(times["fault"]))
                if mode.endswith("kill"):
                    os.kill(os.getpid(), 9)
                raise RuntimeError("injected fault")
            dist.all_reduce(grad)
            if step == 0:
                times["ready"][cw.iteration] = time.time()
        dist.destroy_process_group()
        held.clear()

    os.environ["STEADFAST_EVENTS"] = "off"
    train()
    Path(out).write_text(json.dumps(times))


def _port_pair() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1]) - 1  # the Wrapper listens on MASTER_PORT + 1


def run_once(mode: str, pg_timeout: float, tmp: Path) -> float:
    """One 2-rank run; seconds from the fault to the last rank ready in iteration 1."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port_pair()))
    env["WORLD_SIZE"] = "2"
    outs = [tmp / f"{mode}-{pg_timeout}-{r}-{time.monotonic_ns()}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), mode, str(pg_timeout), str(outs[r])],
            env=dict(env, RANK=str(r)),
        )
        for r in range(2)
    ]
    for p in procs:
        p.wait(timeout=300)
    fault = float(outs[1].with_suffix(".fault").read_text())
    alive = [o for o in outs if o.exists()]
    readies = [json.loads(o.read_text())["ready"]["1"] for o in alive]
    return max(readies) - fault


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = []
        for label, mode, timeout, repeat in (
            ("steadfast, exception, pg timeout 5 s", "raise", 5.0, args.repeat),
            ("steadfast, exception, pg timeout 60 s", "raise", 60.0, args.repeat),
            ("steadfast, SIGKILL, pg timeout 60 s", "kill", 60.0, args.repeat),
            ("NVRx's shape, exception, pg timeout 60 s", "nvrx-raise", 60.0, args.repeat),
            ("NVRx's shape, SIGKILL, pg timeout 60 s", "nvrx-kill", 60.0, args.repeat),
            ("baseline no abort, pg timeout 2 s", "noabort", 2.0, 2),
            ("baseline no abort, pg timeout 5 s", "noabort", 5.0, 2),
        ):
            got = [run_once(mode, timeout, tmp) for _ in range(repeat)]
            rows.append((label, got))
            print(
                f"{label:40s} median {statistics.median(got):7.3f} s   "
                f"max {max(got):7.3f} s   ({repeat} runs)",
                flush=True,
            )
        ours = statistics.median(rows[0][1])
        base = statistics.median(rows[6][1])
        print(
            f"\nfault -> all ranks in the next iteration: {ours:.3f} s with steadfast vs "
            f"{base:.3f} s without the abort at a 5 s timeout: {base / ours:.0f}x faster; "
            f"worst steadfast run over all timeouts: {max(max(g) for _, g in rows[:5]):.3f} s "
            "(target <= 0.5 s)"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5])
    else:
        main()
