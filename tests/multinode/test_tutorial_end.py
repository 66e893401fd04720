"""pytorch/examples' DDP tutorial on the bed (issue 68): ``main()`` holds the DDP model
in its ``Trainer``, destroys the group and returns, with torchrun's command line, on 3
nodes of 2 ranks and a waiting spare; node2 is killed mid-run. Every launcher of the
new round ends 0, the restarted generation resumes from the script's snapshot (on the
shared folder, as the tutorial expects) and trains each epoch after it once on every
rank, and no finished job is trained again (the restarted generation's end was where
one node exited 79, or a third generation trained, in 3 runs of 4 before).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TUTORIAL = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "ddp_tutorial.py"
EPOCHS, SAVE_EVERY, KILL_AT = 16, 4, 6
EPOCH = re.compile(r"\[GPU(\d+)\] Epoch (\d+) ")
RESUMED = re.compile(r"Resuming training from snapshot at Epoch (\d+)")


def _wait_epoch(bed: Any, launch: Any, epoch: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while str(epoch) not in {e for _, e in EPOCH.findall(launch.log.read_text(errors="replace"))}:
        if time.monotonic() > end:
            pytest.fail(f"epoch {epoch} never ran:\n{bed.logs()}")
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["c10d", "steadfast"])
def test_the_tutorial_ends_0_on_every_node_after_a_lost_node_and_trains_each_epoch_once(
    bed_factory: Any, backend: str
):
    bed = bed_factory(4)
    flags = [
        "--nnodes", "3", "--nproc-per-node", "2", "--rdzv-backend", backend,
        "--rdzv-endpoint", "node1:29500", "--rdzv-id", "tutorial", "--max-restarts", "3",
    ]  # fmt: skip
    args = [str(EPOCHS), str(SAVE_EVERY), "--batch_size", "4"]  # ~85 steps an epoch
    launches = [
        bed.launch(n, *flags, script=args, program=TUTORIAL, cwd=bed.shared)
        for n in ("node1", "node2", "node3")
    ]
    _wait_epoch(bed, launches[0], 1)
    launches.append(bed.launch("node4", *flags, script=args, program=TUTORIAL, cwd=bed.shared))
    bed.wait_event("launcher_start", host="node4")  # a spare, waiting to join
    _wait_epoch(bed, launches[0], KILL_AT)
    bed.do("kill", "node2")
    codes = bed.wait_all(launches)
    assert codes["node1"] == codes["node3"] == codes["node4"] == 0, bed.logs()
    assert codes["node2"] != 0
    assert len(bed.events("node_lost", node="node2")) == 1  # the fault, detected
    assert bed.events("node_joined", node="node4")
    # the new round resumed from the snapshot and trained each epoch after it once
    resumed: set[int] = set()
    per_rank: dict[str, list[int]] = {}
    for lc in launches[:1] + launches[2:]:
        text = lc.log.read_text(errors="replace")
        starts = [m.start() for m in RESUMED.finditer(text)]
        assert starts, f"{lc.node} never resumed:\n{lc.tail()}"
        resumed |= {int(e) for e in RESUMED.findall(text)}
        # the first generation ran no snapshot: what follows the first resume is the new one
        for rank, epoch in EPOCH.findall(text[starts[0] :]):
            per_rank.setdefault(rank, []).append(int(epoch))
    assert len(resumed) == 1, resumed
    first = resumed.pop()
    assert first < EPOCHS  # the kill landed mid-run: the new round had epochs to train
    assert sorted(per_rank) == [str(r) for r in range(6)], per_rank
    for rank, epochs in per_rank.items():
        assert epochs == list(range(first, EPOCHS)), (rank, epochs)
    # no node took a rank for hung at the job's end, none trained a third time
    assert not bed.events("rank_hung") and not bed.events("hang_confirmed"), bed.logs()
    for host in ("node1", "node3"):
        assert len(bed.events("workers_started", host=host)) == 2
    assert len(bed.events("workers_started", host="node4")) == 1
    ends = {e["host"]: e["exit_code"] for e in bed.events("launcher_end")}
    assert ends["node1"] == ends["node3"] == ends["node4"] == 0, ends
