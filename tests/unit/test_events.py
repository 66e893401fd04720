"""The event log: schema, validation, where it goes, and many writers on one file."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from steadfast import events


def test_emit_writes_one_json_line_with_common_fields(event_log: Path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    rec = events.emit("nan_detected", step=7, cause="loss", source="loss", value=float("nan"))
    lines = event_log.read_text().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj == rec
    for key in events.COMMON_FIELDS:
        assert key in obj
    assert (obj["kind"], obj["rank"], obj["step"], obj["cause"], obj["restart"]) == (
        "nan_detected",
        3,
        7,
        "loss",
        2,
    )
    assert obj["value"] == "nan"  # non-finite floats stay valid JSON


def test_slurm_fields_only_under_slurm(event_log: Path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert "slurm_job_id" not in events.emit("restart")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    rec = events.emit("restart")
    assert rec["slurm_job_id"] == "42" and rec["slurm_restart"] == 0


def test_unknown_kind_and_clashing_field_are_clear_errors(event_log: Path):
    with pytest.raises(events.EventLogError, match="unknown event kind 'nan_detcted'"):
        events.emit("nan_detcted")
    with pytest.raises(events.EventLogError, match="common fields"):
        events.emit("restart", time=3)
    with pytest.raises(events.EventLogError, match="lower_snake_case"):
        events.register_kind("Bad-Kind", "x")
    assert not event_log.exists()


def test_register_kind_is_accepted(event_log: Path):
    events.register_kind("unit_test_kind", "a test kind; fields: none")
    try:
        events.emit("unit_test_kind")
    finally:
        del events.EVENT_KINDS["unit_test_kind"]
    assert json.loads(event_log.read_text())["kind"] == "unit_test_kind"


def test_where_events_go(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(events.EVENTS_ENV, raising=False)
    events.set_default_path(None)
    assert events.current_path() == str(tmp_path / events.DEFAULT_EVENTS_FILE)
    events.emit("restart")
    assert len((tmp_path / "steadfast_events.jsonl").read_text().splitlines()) == 1
    default = tmp_path / "sub" / "default.jsonl"
    events.set_default_path(default)
    events.emit("restart")
    assert len(default.read_text().splitlines()) == 1
    env_path = tmp_path / "env.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(env_path))
    events.emit("restart")
    assert len(env_path.read_text().splitlines()) == 1
    assert len(default.read_text().splitlines()) == 1
    monkeypatch.setenv(events.EVENTS_ENV, "off")
    assert events.current_path() is None
    assert events.emit("restart")["kind"] == "restart"  # still returns the record
    assert len(env_path.read_text().splitlines()) == 1
    events.set_default_path(None)


def _log_fds(path: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return n


def test_forked_child_writes_through_its_own_fd(event_log: Path):
    events.emit("restart", step=1)
    assert _log_fds(event_log) == 1
    pid = os.fork()
    if pid == 0:  # child: the inherited fd was closed at fork, one is opened on use
        code = 0 if _log_fds(event_log) == 0 else 3
        events.emit("restart", step=2)
        code = code or (0 if _log_fds(event_log) == 1 else 4)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    events.emit("restart", step=3)
    steps = [json.loads(x)["step"] for x in event_log.read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_unwritable_log_does_not_raise(tmp_path: Path, monkeypatch, caplog):
    target = tmp_path / "a_dir"
    target.mkdir()
    monkeypatch.setenv(events.EVENTS_ENV, str(target))  # a directory cannot be opened
    events.emit("restart")
    assert "cannot write event restart" in caplog.text


def test_read_events_skips_truncated_line_and_reports_it(tmp_path: Path, monkeypatch):
    path = tmp_path / "e.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    events.emit("restart", step=1)
    events.emit("checkpoint_saved", step=2, path="x", bytes=1, seconds=0.1, blocking_seconds=0.1)
    with path.open("a") as fh:
        fh.write('{"time": 1.0, "kind": "rest')  # a writer killed mid-line
    problems: list[str] = []
    got = list(events.read_events(path, problems=problems))
    assert [e.kind for e in got] == ["restart", "checkpoint_saved"]
    assert got[1].get("bytes") == 1
    assert len(problems) == 1 and f"{path}:3" in problems[0]
    with pytest.raises(events.EventLogError, match=r"e\.jsonl:3: not valid JSON"):
        list(events.read_events(path, strict=True))


def test_read_events_type_errors_name_the_field(tmp_path: Path):
    path = tmp_path / "e.jsonl"
    path.write_text('{"time": 1, "kind": "restart", "step": "seven"}\n')
    with pytest.raises(events.EventLogError, match="field 'step'"):
        list(events.read_events(path, strict=True))
    with pytest.raises(events.EventLogError, match="does not exist"):
        list(events.read_events(tmp_path / "missing.jsonl"))


_WRITER = """
import sys
from steadfast import events
tag, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    # sizes up to ~9 KB: larger than PIPE_BUF, still one write() each
    events.emit("fault_injected", step=i, cause=tag, fault="x" * (i % 9000))
"""


def test_many_processes_append_to_one_file(event_log: Path):
    n = 400
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, tag, str(n)]) for tag in ("a", "b", "c")
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    lines = event_log.read_text().splitlines()
    assert len(lines) == 3 * n
    parsed = [json.loads(line) for line in lines]  # every line is valid JSON
    for tag in ("a", "b", "c"):
        assert sorted(e["step"] for e in parsed if e["cause"] == tag) == list(range(n))
