"""The worker template: workers forked from a process that imported torch already."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from steadfast import seam
from steadfast.launcher.template import Template, parse_python_argv

SCRIPT = """
import os, signal, sys, time
import torch
mode = sys.argv[1]
session = os.getpgid(0) == os.getpid()
print("argv", sys.argv[1:], "env", os.environ.get("SF_TEST"), "session", session, flush=True)
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("boom")
if mode == "sleep":
    time.sleep(60)
print("torch", torch.ones(2).sum().item())
"""


@pytest.fixture
def template():
    t = Template()
    yield t
    t.close()


def test_parse_python_argv():
    assert parse_python_argv(["-u", "train.py", "--x"]) == ("path", "train.py", ["--x"])
    assert parse_python_argv(["-u", "-m", "pkg.mod", "a"]) == ("module", "pkg.mod", ["a"])
    assert parse_python_argv(["-c", "print(1)"]) is None


@pytest.mark.parametrize(("mode", "code"), [("ok", 0), ("exit3", 3), ("raise", 1)])
def test_workers_run_scripts_and_report_exit_codes(template: Template, tmp_path: Path, mode, code):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.txt"
    env = dict(os.environ, SF_TEST="yes")
    proc = template.spawn(
        ["-u", str(script), mode], env, cwd=str(tmp_path), stdout=str(out), stderr=str(out)
    )
    assert proc.wait(60) == code
    text = out.read_text()
    assert f"argv ['{mode}'] env yes session True" in text
    if mode == "ok":
        assert "torch 2.0" in text
    if mode == "raise":
        assert "RuntimeError: boom" in text


def _spawn_sleeper(template: Template, tmp_path: Path):
    """A worker that runs SCRIPT in ``sleep`` mode (it stays until it is ended)."""
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    out = str(tmp_path / "o")
    return template.spawn(
        ["-u", str(script), "sleep"], dict(os.environ), cwd=str(tmp_path), stdout=out, stderr=out
    )


def test_a_killed_worker_reports_the_signal(template: Template, tmp_path: Path):
    proc = _spawn_sleeper(template, tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.3)
    os.killpg(proc.pid, signal.SIGKILL)  # its own session, as torch's agent expects
    assert proc.wait(30) == -signal.SIGKILL


def test_closing_the_template_ends_its_workers(tmp_path: Path):
    t = Template()
    proc = _spawn_sleeper(t, tmp_path)
    t.close()
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    assert proc.poll() == -signal.SIGKILL


def test_module_mode(template: Template, tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    proc = template.spawn(["-u", "-m", "pkg.job", "7"], dict(os.environ), cwd=str(tmp_path))
    assert proc.wait(60) == 7


WHICH_PRELOADS = """
import sys
print(*(name in sys.modules for name in ("torch._dynamo", "torch._inductor.compile_fx")))
"""


@pytest.mark.skipif(seam.cuda_built(), reason="a CUDA build probes each preload first")
def test_workers_are_forked_before_the_compiler_is_preloaded_and_later_ones_have_it(
    template: Template, tmp_path: Path
):
    """Without CUDA the template imports dynamo (every optimizer needs it) before it
    serves, and Inductor's compiler only once it forked its first workers: a cold start
    does not wait ~2 s for what only a compiling script uses; later workers have it."""
    script = tmp_path / "which.py"
    script.write_text(WHICH_PRELOADS)

    def spawned() -> str:
        out = tmp_path / "which.txt"
        proc = template.spawn([str(script)], dict(os.environ), stdout=str(out), stderr=str(out))
        assert proc.wait(60) == 0, out.read_text()
        return out.read_text().strip()

    assert spawned() == "True False"
    deadline = time.monotonic() + 120
    while (seen := spawned()) != "True True" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert seen == "True True"


PRELOADS = """
import sys, time
from steadfast import seam
from steadfast.launcher import preload
poisons = sys.argv[1] == "poisons"
seam.cuda_fork_poisoned = lambda: poisons  # a CUDA build's import that asks for the GPUs
p = preload.Preloader(["colorsys", "no_such_module_here"])
p._probing = True  # as on a torch built with CUDA
busy_polls = 0
p.poll(idle=True)  # starts colorsys's probe, returns at once
while p.pending():
    busy = busy_polls <= 3
    p.poll(idle=not busy)  # busy for a while: a cleared import waits for idleness
    assert not busy or "colorsys" not in sys.modules  # probed in the child only
    busy_polls += 1
    time.sleep(0.01)
print("colorsys" in sys.modules, "no_such_module_here" in sys.modules)
"""


@pytest.mark.parametrize("poisons", ["clean", "poisons"])
def test_a_preload_is_imported_only_once_a_forked_probe_found_forks_still_usable(poisons):
    """On a CUDA build the template imports a preload only after a forked child imported
    it and a grandchild of that child could still have used CUDA (seen on a lent H200:
    Inductor's compiler poisoned every later fork); the template polls the probe, never
    waits for it; a module that cannot be imported, or that poisons, is left to the
    workers."""
    import sys

    done = subprocess.run(
        [sys.executable, "-c", PRELOADS, poisons], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["True", "False"] if poisons == "clean" else ["False", "False"])
