"""The worker's side of its end (issue 68, steadfast.launcher.worker_end): the groups a
script destroys are kept until the interpreter's exit, so that a DDP model freed after
``destroy_process_group()`` (the DDP tutorial's ``main()`` returning) never runs
``~ProcessGroupGloo`` from its Reducer with the GIL held (the deadlock itself is a race,
seen under gdb, and measured by ``bench/bench_restart_ends.py``); the worker marks
``COLLECTIVES_DONE`` in its row."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from steadfast.monitor.table import HeartbeatTable
from steadfast.progress.layout import COLLECTIVES_DONE, FINISHED

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from steadfast.launcher.worker_end import install, kept_groups
    install()
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def gloo_threads():
        names = (open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task"))
        return sum("gloo" in name for name in names)

    def main():  # the tutorial's shape: the DDP model in a local of main()
        dist.init_process_group("gloo", init_method=sys.argv[2], rank=0, world_size=1)
        if sys.argv[1] == "ddp":
            trainer = {"model": DDP(torch.nn.Linear(4, 1))}
            trainer["model"](torch.randn(2, 4)).sum().backward()
            group = id(trainer["model"].process_group)
        else:
            dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()
        kept = kept_groups()
        if sys.argv[1] == "ddp":
            print("in main: kept", len(kept), "same", id(kept[0]) == group, flush=True)
        else:
            print("in main: kept", len(kept), "gloo threads", gloo_threads(), flush=True)

    main()
    print("after main: kept", len(kept_groups()), flush=True)
    """
)


def _run(tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "tutorial_end.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode, f"tcp://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_destroyed_group_a_ddp_model_still_holds_is_kept_until_the_exit(
    tmp_path: Path,
):
    """After ``destroy_process_group()`` the group the live DDP model holds is kept here
    (so the Reducer's release, as ``main()`` returns, is not its last), then freed at
    the exit: exit 0."""
    out = _run(tmp_path, "ddp")
    assert "in main: kept 1 same True" in out
    assert "after main: kept" in out


def test_a_destroyed_group_nothing_holds_is_freed_at_once(tmp_path: Path):
    """As torch frees it: its gloo threads end within the destroy."""
    out = _run(tmp_path, "plain")
    assert "in main: kept 0 gloo threads 0" in out


def test_the_destroy_marks_collectives_done_in_the_workers_row(tmp_path: Path):
    table = HeartbeatTable.create(1, directory=str(tmp_path))
    try:
        env = {**os.environ, "STEADFAST_HB_TABLE": str(table.path), "LOCAL_RANK": "0"}
        _run(tmp_path, "ddp", env)
        slots, _ = table.progress_area(0)
        assert slots[COLLECTIVES_DONE] > 0  # the destroy returned
        assert slots[FINISHED] == 0  # a plain interpreter ran the script: no as_main
    finally:
        table.close()
