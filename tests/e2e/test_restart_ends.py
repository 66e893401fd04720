"""The end of a job after a restart (issue 68), in the shape most users copy:
pytorch/examples' DDP tutorial (``bench/scripts/ddp_tutorial.py``: ``main()`` holds the
DDP model in its ``Trainer``, calls ``destroy_process_group()`` and returns), under the
torchrun command line users type (``--rdzv-backend c10d``), rank 1 killed once mid-run.

The job must end 0, with the kill detected (``rank_failed``, SIGKILL) and one restart,
the restarted generation resuming from the script's own snapshot and training each
epoch after it once, and no epoch trained after the job's last. The script never seeds
(its data is ``torch.rand``): no bit-exact comparison applies to it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "bench" / "scripts" / "ddp_tutorial.py"
EPOCHS, SAVE_EVERY, KILL_AT = 12, 4, 6
EPOCH = re.compile(r"\[GPU(\d)\] Epoch (\d+) ")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("no_worker_outlives_its_launcher"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def run_killed_once(tmp_path: Path, *flags: str) -> tuple[int, list[str], list[dict]]:
    """The tutorial under ``steadfast launch``, rank 1 SIGKILLed once it starts epoch
    :data:`KILL_AT`; (exit code, its output's lines, the events)."""
    log = tmp_path / "run" / "events.jsonl"
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", f"--run-dir={tmp_path / 'run'}",
        "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{_port()}", *flags, str(TUTORIAL), str(EPOCHS),
        str(SAVE_EVERY), "--batch_size", "4",  # 256 steps an epoch: the kill lands mid-run
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    killed = False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not killed and ("1", str(KILL_AT)) in EPOCH.findall(line):
            started = [e for e in _events(log) if e["kind"] == "workers_started"][-1]
            os.kill(dict(zip(started["ranks"], started["pids"], strict=True))[1], signal.SIGKILL)
            killed = True
    code = proc.wait(timeout=240)
    if code != 0:
        print("".join(lines[-80:]))
    assert killed, "rank 1 never reached the epoch it is killed at"
    return code, lines, _events(log)


@pytest.mark.parametrize("template", ["true", "false"])
def test_the_tutorial_ends_0_after_a_restart_and_trains_each_epoch_once_after_it(
    tmp_path: Path, template: str
):
    """Forked from the worker template, and started as plain processes (the boot)."""
    code, lines, evs = run_killed_once(tmp_path, f"--ft-worker-template={template}")
    assert code == 0
    kinds = [e["kind"] for e in evs]
    assert kinds.count("workers_started") == 2  # one restart, and no third training
    [failed] = [e for e in evs if e["kind"] == "rank_failed"]
    assert (failed["rank"], failed["signal"]) == (1, "SIGKILL")  # the fault, detected
    [end] = [e for e in evs if e["kind"] == "launcher_end"]
    assert end["exit_code"] == 0
    # the restarted generation resumed from the script's snapshot (rank 0 saves every
    # SAVE_EVERY epochs, EPOCHS_RUN = the epoch saved) and trained each epoch once
    text = "".join(lines)  # two ranks' lines may share a line
    resumed = [int(e) for e in re.findall(r"Resuming training from snapshot at Epoch (\d+)", text)]
    assert len(resumed) == 2 and resumed[0] == resumed[1] <= KILL_AT
    epochs = EPOCH.findall(text[text.rindex("Resuming training") :])
    for rank in ("0", "1"):
        after = [int(e) for r, e in epochs if r == rank]
        assert after == list(range(resumed[0], EPOCHS)), (rank, after)
    assert not [e for e in evs if e["kind"] in ("rank_hung", "hang_confirmed")]
    exited = [e for e in evs if e["kind"] == "workers_exited"]
    assert exited[-1]["cause"] == "succeeded"
    assert {x["exit_code"] for x in exited[-1]["exits"]} == {0}
