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


# ---------------------------------------------------------------------- the schema is code
def test_an_undeclared_field_is_a_clear_error(event_log: Path):
    with pytest.raises(
        events.EventLogError, match=r"'restart': undeclared field\(s\) \['restart_cnt'\]"
    ):
        events.emit("restart", restart_count=1, restart_cnt=1)
    with pytest.raises(events.EventLogError, match="common fields"):
        events.register_kind("unit_test_kind", "x", ["host"])
    assert not event_log.exists()


def test_reading_an_undeclared_field_is_a_clear_error():
    e = events.parse_event('{"time": 1, "kind": "step_done", "seconds": 0.5, "pid": 3}')
    assert e.get("seconds") == 0.5 and e.get("loss") is None and e.get("pid") == 3
    with pytest.raises(events.EventLogError, match="'step_done' has no field 'second'"):
        e.get("second")
    newer = events.parse_event('{"time": 1, "kind": "from_a_newer_writer", "x": 1}')
    assert newer.get("x") == 1  # a kind this version does not know is read as it is


def _sample(name: str) -> object:
    """A plausible value for a field, by its name."""
    if name in ("relative", "individual", "scores", "details"):
        return {"0": 1.0}
    if name == "exits":
        return [{"rank": 0, "local_rank": 0, "pid": 5, "exit_code": 0, "signal": None, "time": 1.5}]
    if name == "rendezvous":
        return [1.0, 1.5]
    if name in ("ranks", "pids", "replaced", "terminated"):
        return [0] if name != "replaced" else ["h"]
    if name in ("resumed_from", "path", "section", "reason", "detail", "source", "action",
                "signal", "verdict", "slurm_job", "fault", "causes"):  # fmt: skip
        return "x" if name != "fault" else "rank_killed"
    return 1


def test_every_field_the_report_reads_is_declared_for_its_kind(tmp_path: Path):
    """One event of every kind, every declared field filled, in two process generations,
    through everything that reads a log (the report, its table, the timeline, the demo's
    progress line): :meth:`Event.get` raises for a field its kind does not declare."""
    from steadfast.demo import _Progress
    from steadfast.report import compute_report, format_report, load_events

    lines = []
    for i, (kind, spec) in enumerate(sorted(events.EVENT_KINDS.items())):
        for pid in (100, 200):
            fields = {name: _sample(name) for name in spec.fields}
            lines.append(json.dumps({"time": i + (pid // 100) * 100.0, "kind": kind, "rank": 0,
                                     "step": i, "cause": "c", "host": "h", "pid": pid,
                                     "restart": 0, "slurm_job_id": "7", "slurm_restart": 0,
                                     **fields}))  # fmt: skip
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join(lines) + "\n")
    evs, problems = load_events(log)
    report = compute_report(evs, problems)
    assert report.faults and not problems
    format_report(report)
    progress = _Progress(log, tty=False)
    progress.poll()
    progress.draw(force=True)
    try:
        from steadfast.report import plot_timeline

        plot_timeline(evs, tmp_path / "timeline.png")
    except ImportError:  # matplotlib is an extra
        pass


def test_the_readers_only_name_declared_fields():
    """Every field name the report and the demo read with ``.get("...")`` is declared by
    some kind (or common): a typo there fails here, even on a path no log reaches."""
    import ast

    src = Path(events.__file__).parent.parent  # the steadfast package
    declared = set(events.COMMON_FIELDS) | set(events.SLURM_FIELDS)
    for spec in events.EVENT_KINDS.values():
        declared |= set(spec.fields)
    read = set()
    for path in [*sorted((src / "report").glob("*.py")), src / "demo.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name)  # an event (os.environ is not)
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                read.add(node.args[0].value)
    assert read and read <= declared, sorted(read - declared)


def test_every_kind_name_has_its_schema():
    """``Kind`` names the built-in kinds the readers compare with; each has its row in
    the schema, and each member is the very string written to the log."""
    assert {str(k) for k in events.Kind} <= set(events.EVENT_KINDS)
    assert events.Kind.NODE_LOST == "node_lost" and f"{events.Kind.NODE_LOST}" == "node_lost"
    assert json.loads(json.dumps({"kind": events.Kind.STEP_DONE}))["kind"] == "step_done"


def test_the_readers_compare_kinds_by_the_schemas_names():
    """No code of steadfast compares an event's ``kind`` with a hand-typed string (a typo
    there would match nothing, silently): readers use :class:`steadfast.events.Kind`."""
    import ast

    src = Path(events.__file__).parent.parent
    typed = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if not any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides):
                continue
            for side in sides:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                typed += [
                    f"{path.relative_to(src)}:{node.lineno} {i.value!r}"
                    for i in items
                    if isinstance(i, ast.Constant) and i.value in events.EVENT_KINDS
                ]
    assert typed == [], typed
