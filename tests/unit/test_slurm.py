"""Slurm job info from the environment, as real Slurm sets it."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from steadfast import (
    ConfigError,
    SLURMInfo,
    get_slurm_info,
    is_slurm_job,
    is_slurm_requeue,
    log_job_info,
)

_ALL = [
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_RESTART_COUNT",
    "SLURM_JOB_PARTITION",
    "SLURM_ARRAY_TASK_ID",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)


def test_not_under_slurm(caplog):
    assert get_slurm_info() is None
    assert not is_slurm_job()
    assert not is_slurm_requeue()
    with caplog.at_level(logging.INFO):
        log_job_info()
    assert "Not running under SLURM" in caplog.text


def test_full_environment(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    info = get_slurm_info()
    assert info == SLURMInfo("1234", "train", "node[01-02]", 2, 4, 0, "gpu", "7")
    assert is_slurm_job()


def test_restart_count_unset_until_first_requeue(monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    info = get_slurm_info()
    assert info is not None and info.restart_count == 0 and not info.is_requeued
    assert info.array_task_id is None
    assert not is_slurm_requeue()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert is_slurm_requeue()
    info = get_slurm_info()
    assert info is not None and info.is_requeued
    with caplog.at_level(logging.INFO):
        log_job_info()
    assert "restart #2" in caplog.text


def test_fallback_variables(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NNODES", "3")
    monkeypatch.setenv("SLURM_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2),3")
    info = get_slurm_info()
    assert info is not None
    assert (info.num_nodes, info.node_list, info.ntasks_per_node) == (3, "n[1-3]", 8)


def test_malformed_variable_names_it(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "two")
    with pytest.raises(ConfigError, match="SLURM_RESTART_COUNT='two' is not an integer"):
        get_slurm_info()
    with pytest.raises(ConfigError, match="SLURM_RESTART_COUNT"):
        is_slurm_requeue()


# ----------------------------------------------------------------- job retries, sbatch


def test_failure_requeues_count_only_failures_of_this_job(monkeypatch, event_log):
    from steadfast import events
    from steadfast.slurm import failure_requeues

    assert failure_requeues("7") == 0  # no log yet: nothing was requeued
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    for cause, job in [
        ("restarts_exhausted", "7"),
        ("preempted", "7"),  # a preemption spends no retry
        ("restart_elsewhere", "7"),
        ("restarts_exhausted", "8"),  # another job's
    ]:
        events.emit("job_requeued", cause=cause, slurm_job=job)
    assert failure_requeues("7") == 2
    assert failure_requeues("7", restart_count=3) == 2  # the log has the earlier runs
    # a requeued job whose log holds nothing of its earlier runs cannot count them
    assert failure_requeues("9", restart_count=1) is None
    monkeypatch.setenv(events.EVENTS_ENV, events.EVENTS_OFF)
    assert failure_requeues("7") is None  # no log: the caller uses SLURM_RESTART_COUNT


def test_doubted_hosts_are_this_incarnations_rerun_elsewhere_hosts(monkeypatch, event_log):
    """The hosts a requeue after exit 16 keeps the job away from: those of the
    rerun_elsewhere events of this job and this SLURM_RESTART_COUNT only."""
    import json

    from steadfast import events
    from steadfast.slurm import doubted_hosts

    assert doubted_hosts("7") == []  # no log yet
    rows = [
        ("7", 0, "node3", "rerun_elsewhere"),
        ("7", 0, "node3", "rerun_elsewhere"),  # two ranks of one node: once
        ("7", 0, "node5", "rerun_result_rejected"),  # rejected, not (yet) reproduced
        ("7", 1, "node4", "rerun_elsewhere"),  # the next incarnation's
        ("8", 0, "node6", "rerun_elsewhere"),  # another job's
    ]
    with event_log.open("w") as fh:
        for job, restart, host, kind in rows:
            fields = {"hardware": f"{host}/cpu"} if kind == "rerun_elsewhere" else {}
            fh.write(json.dumps({"time": 1.0, "kind": kind, "rank": 1, "step": 5,
                                 "cause": "c", "host": host, "pid": 1, "restart": 0,
                                 "slurm_job_id": job, "slurm_restart": restart,
                                 **fields}) + "\n")  # fmt: skip
    assert doubted_hosts("7", 0) == ["node3"]
    assert doubted_hosts("7", 1) == ["node4"]
    monkeypatch.setenv(events.EVENTS_ENV, events.EVENTS_OFF)
    assert doubted_hosts("7", 0) == []  # no log: nothing to exclude


def test_the_requeues_signals_are_held_even_when_another_thread_takes_them():
    """A process signal goes to any thread that does not block it, and Python runs the
    handler in the main thread all the same (a mask on the main thread alone, the way
    it was done before, lets this test fail): the requeue holds them by handler. A
    SIGUSR2 sent while held reaches the original handler only on the way out."""
    import os
    import signal
    import threading
    import time

    from steadfast.slurm.requeue import _signals_held

    seen: list[int] = []
    before = signal.signal(signal.SIGUSR2, lambda signum, _frame: seen.append(signum))
    done = threading.Event()
    other = threading.Thread(target=done.wait)  # a thread that takes process signals
    other.start()
    try:
        with _signals_held():
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.1)  # the main thread runs Python's handlers between bytecodes
            assert seen == []
        assert seen == [signal.SIGUSR2]
    finally:
        done.set()
        other.join()
        signal.signal(signal.SIGUSR2, before)


def test_a_shielded_scontrol_survives_a_sigterm_from_its_first_instant(tmp_path, monkeypatch):
    """Slurm SIGTERMs every process of a job it requeues, the ``scontrol update`` that
    sets the job's ``ExcNodeList`` included. Here a thread SIGTERMs every child of this
    process without pause while a (fake) scontrol runs: each run must still end with its
    output. The shell's ``trap`` alone let the signal through between the fork and the
    trap (CI: ``failed (exit -15)``, and the requeued job went back to the doubted node)."""
    import os
    import signal
    import threading
    from pathlib import Path

    from steadfast.slurm.requeue import _scontrol

    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\nsleep 0.05\necho "updated $*"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    stop = threading.Event()
    hits = [0]

    from sfharness import template_pid

    harness = template_pid()  # the session's rank template: the harness's, not the job's

    def children() -> set[int]:
        found: set[int] = set()
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (task / "children").read_text().split())
        return found - {harness}

    def sigterm_children() -> None:
        while not stop.is_set():
            for pid in children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                    hits[0] += 1

    killer = threading.Thread(target=sigterm_children)
    killer.start()
    try:
        for _ in range(10):
            assert _scontrol(["update", "JobId=7"], 10, shielded=True) == "updated update JobId=7\n"
    finally:
        stop.set()
        killer.join()
    assert hits[0] >= 10  # every run was signalled, over and over


def test_the_requeue_counts_when_slurm_sigterms_its_own_scontrol(tmp_path, monkeypatch, event_log):
    """Slurm SIGTERMs every process of the job it requeues as soon as it accepts the
    requeue, the ``scontrol requeue`` itself included, often before it exits. The
    (fake) scontrol here does that to itself after accepting: the requeue must still
    count (``job_requeued``), so that its exclusion is made too (CI: "scontrol requeue 5
    failed (exit -15)", no exclusion, and the job came back on the doubted node)."""
    import os

    from sfharness import read_events
    from steadfast.slurm import requeue_job

    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(  # accepts the requeue, then gets the job's SIGTERM
        f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" = requeue ] && kill -TERM $$ && sleep 0.2\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert requeue_job("7", cause="restart_elsewhere") is True
    (requeued,) = [e for e in read_events(event_log) if e["kind"] == "job_requeued"]
    assert requeued["cause"] == "restart_elsewhere"
    assert "requeue 7" in calls.read_text().splitlines()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 5400), ("5:30", 360), ("1:00:00", 3600), ("2-3", 183600), ("1-0:10", 87000),
     ("0-0:0:45", 60), (" 2 ", 120)],
)  # fmt: skip
def test_parse_time_limit(text, seconds):
    from steadfast.slurm import parse_time_limit

    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["", "UNLIMITED", "1h", "0", "1:2:3:4", "-5"])
def test_parse_time_limit_rejects(text):
    from steadfast.slurm import parse_time_limit

    with pytest.raises(ConfigError, match=r"^time: .* is not a Slurm time limit"):
        parse_time_limit(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"script": " "}, "script: the training script is missing"),
        ({"nodes": 0}, "nodes"),
        ({"nproc_per_node": "four"}, "nproc_per_node: expected a positive integer"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"num_job_retries_on_failure": 1.5}, "num_job_retries_on_failure"),
        ({"rdzv_port": 70000}, "rdzv_port: 70000 is not a TCP port"),
        ({"rdzv_backend": "zookeeper"}, "rdzv_backend: 'zookeeper' .expected one of steadfast"),
        ({"rdzv_backend": "etcd-v2"}, "rdzv_endpoint: rdzv_backend=etcd-v2 needs the etcd"),
        ({"rdzv_endpoint": "a:1, b:2"}, "rdzv_endpoint: 'a:1, b:2' must be one word"),
        ({"job_name": "my job"}, "job_name"),
        ({"preempt_signal": "KILL"}, "preempt_signal: SIGKILL cannot be the preemption"),
        ({"preempt_signal": "CHLD"}, "preempt_signal: SIGCHLD cannot be the preemption"),
        ({"partition": "gpu\nrm -rf /"}, "partition: .* must be one word on one line"),
        ({"run_dir": "my runs"}, "run_dir: 'my runs' must be one word"),
        ({"script": "a.py\nrm"}, "script: .* must be one word on one line"),
        ({"preempt_signal": "SIGFOO"}, "preempt_signal: 'SIGFOO' is not a signal"),
        ({"time": "5", "preempt_time": 300}, "preempt_time: 300 s before a time limit of 300"),
        ({"nproc_per_node": "\u00b2"}, "nproc_per_node: expected a positive integer"),
        ({"time": "soon"}, "time: 'soon' is not a Slurm time limit"),
        ({"sbatch_lines": ["qos=high"]}, r"sbatch_lines\[0\]: 'qos=high' is not one sbatch"),
        ({"setup": ["a\nb"]}, r"setup\[0\]: one shell line"),
    ],
)
def test_sbatch_spec_errors_name_the_field(kwargs, message):
    from steadfast.slurm import SbatchSpec

    with pytest.raises(ConfigError, match=message):
        SbatchSpec(**{"script": "train.py", **kwargs})


def test_rendered_script_is_valid_bash_with_every_option(tmp_path):
    import subprocess

    from steadfast.slurm import SbatchSpec, render_sbatch

    spec = SbatchSpec(
        script="train.py",
        script_args=["--ckpt-dir", "runs/my ckpt", "--lr=1e-3"],
        nodes=4,
        nproc_per_node="gpu",
        job_name="llm",
        partition="gpu",
        account="proj",
        time="4:00:00",
        gpus_per_node=8,
        cpus_per_task=32,
        preempt_signal="SIGTERM",
        preempt_time=300,
        max_restarts=5,
        num_job_retries_on_failure=1,
        rdzv_port=29555,
        python="/opt/venv/bin/python",
        sbatch_lines=["#SBATCH --qos=high", "--exclusive"],
        setup=["module load cuda"],
        launcher_args=["--ft-cfg-path", "ft.yaml"],
        srun_args=["--cpu-bind=none"],
    )
    text = render_sbatch(spec, "steadfast slurm ...")
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    sbatch = [
        line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")
    ]
    assert sbatch == [
        "--job-name=llm", "--nodes=4", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
        "--output=runs/llm/slurm-%j.out", "--time=4:00:00", "--signal=B:TERM@300",
        "--partition=gpu", "--account=proj", "--gpus-per-node=8", "--cpus-per-task=32",
        "--qos=high", "--exclusive",
    ]  # fmt: skip
    assert "srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=0 --cpus-per-task=32" in text
    assert '--rdzv-endpoint="$SF_HEAD:$SF_RDZV_PORT" --rdzv-id="$SLURM_JOB_ID"' in text
    assert "--max-restarts=5 --ft-num-job-retries-on-failure=1" in text
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT\n" in text.replace(" \\", "")
    assert "trap 'sf_forward TERM' TERM" in text
    # srun would end the step on TERM: the signal goes to the steps through scancel
    assert 'scancel --signal="$1" "$SLURM_JOB_ID"' in text and "kill -s" not in text
    assert "--kill-on-bad-exit=0 --cpus-per-task=32 --cpu-bind=none" in text
    assert 'if [ -n "$sf_preempted" ] && [ "$sf_rc" -ne 0 ]; then' in text  # not a done run
    assert "set -u" not in text  # a setup line may read unset variables (conda, module)
    assert "train.py --ckpt-dir 'runs/my ckpt' --lr=1e-3 &" in text
    assert "SF_RDZV_PORT=29555\n" in text
    assert "SF_PYTHON=/opt/venv/bin/python" in text and "\nmodule load cuda\n" in text


def test_the_batch_script_makes_one_secret_per_job_and_keeps_it_across_requeues(tmp_path):
    """The job's secret (steadfast.secret): the batch script makes a 0600 file in the run
    folder the first time, exports its path to the launchers, and a requeued job (the
    same id) keeps it; a secret the user gives is left as it is."""
    import os
    import stat
    import subprocess
    import sys

    from steadfast.slurm import SbatchSpec, render_sbatch

    text = render_sbatch(SbatchSpec(script="train.py", nodes=2), "steadfast slurm ...")
    lines = text.splitlines()
    first = lines.index(next(ln for ln in lines if ln.startswith("# the job's secret")))
    block = "\n".join(lines[first : lines.index("fi", first) + 1])
    script = f'{block}\necho "$STEADFAST_JOB_SECRET_FILE"\n'
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEADFAST_JOB_SECRET")}
    env.update(SF_RUN_DIR=str(tmp_path), SF_PYTHON=sys.executable, SLURM_JOB_ID="4242")

    def run(**extra: str) -> str:
        done = subprocess.run(["bash", "-c", script], env={**env, **extra},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    path = run()
    assert path == str(tmp_path / ".secret-4242")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = Path(path).read_text()
    assert len(secret.strip()) == 64
    assert run() == path and Path(path).read_text() == secret  # a requeue: the same one
    assert run(STEADFAST_JOB_SECRET_FILE="/given") == "/given"


def test_spare_nodes_are_allocated_and_run_a_launcher_that_waits():
    """--spare-nodes 1 on 2 nodes: 3 nodes allocated, a launcher on each, --nnodes=2 (the
    third waits in the rendezvous); --no-kill so that Slurm does not end the job when it
    loses one. Without spares there is no --no-kill: Slurm's own NODE_FAIL requeue stays
    for a lost first node (which takes the batch script with it)."""
    from steadfast.config import ConfigError
    from steadfast.slurm import SbatchSpec, render_sbatch

    text = render_sbatch(SbatchSpec(script="t.py", nodes=2, spare_nodes=1))
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill\n" in text
    assert "srun --nodes=3 --ntasks-per-node=1 --no-kill " in text
    assert "--nnodes=2 --nproc-per-node=1" in text
    assert "and 1 spare node(s)." in text
    single = render_sbatch(SbatchSpec(script="t.py"))
    assert "--no-kill" not in single and "--nnodes=1 " in single
    assert "--no-kill" not in render_sbatch(SbatchSpec(script="t.py", nodes=4))
    with pytest.raises(ConfigError, match="spare_nodes"):
        SbatchSpec(script="t.py", spare_nodes=-1)


def test_without_a_time_limit_there_is_no_signal_option():
    from steadfast.slurm import SbatchSpec, render_sbatch

    text = render_sbatch(SbatchSpec(script="t.py"))
    assert "#SBATCH --signal=" not in text and "#SBATCH --time=" not in text
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text
    assert "trap 'sf_forward USR1' USR1" in text
    # the ranks learn the job's preemption signal (PreemptionHandler takes it as well)
    assert "export STEADFAST_PREEMPT_SIGNAL=USR1" in text
    assert "SF_RDZV_PORT=$((29400 + SLURM_JOB_ID % 1000))" in text  # jobs sharing a node


def test_an_etcd_rendezvous_outside_the_job_replaces_the_first_nodes_store(tmp_path):
    import subprocess

    from steadfast.slurm import SbatchSpec, render_sbatch

    endpoint = "etcd1:2379,etcd2:2379,etcd3:2379"
    text = render_sbatch(
        SbatchSpec(script="t.py", nodes=4, rdzv_backend="etcd-v2", rdzv_endpoint=endpoint)
    )
    (tmp_path / "job.sbatch").write_text(text)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert f'--rdzv-backend=etcd-v2 --rdzv-endpoint={endpoint} --rdzv-id="$SLURM_JOB_ID"' in text
    assert '--rdzv-endpoint="$SF_HEAD' not in text
    assert f"rendezvous etcd-v2 {endpoint}" in text


def test_slurm_command_writes_the_script_and_names_a_bad_flag(tmp_path, capsys, monkeypatch):
    from steadfast.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "--nodes", "2", "--write", "job.sbatch", "train.py", "--steps", "9"]) == 0
    text = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "train.py --steps 9 &" in text
    assert (tmp_path / "runs" / "steadfast").is_dir()  # Slurm needs the output's folder
    assert main(["slurm", "--time", "1", "--preempt-time", "60", "train.py"]) == 2
    assert "preempt_time: 60 s before a time limit of 60 s" in capsys.readouterr().err
