"""The worker template: workers forked from a process that imported torch already."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steadfast import seam
from steadfast.launcher.preload import uncollected
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
def test_the_compiler_is_preloaded_only_once_the_launcher_asks_and_later_workers_have_it(
    template: Template, tmp_path: Path
):
    """Without CUDA the template imports dynamo (every optimizer needs it) before it
    serves, and Inductor's compiler only once the launcher asks for it (a worker of the
    job compiled): a job that never compiles neither waits for it nor pays its import
    and its teardown in every worker; later workers have it."""
    script = tmp_path / "which.py"
    script.write_text(WHICH_PRELOADS)

    def spawned() -> str:
        out = tmp_path / "which.txt"
        proc = template.spawn([str(script)], dict(os.environ), stdout=str(out), stderr=str(out))
        assert proc.wait(60) == 0, out.read_text()
        return out.read_text().strip()

    assert spawned() == "True False"
    time.sleep(1.0)  # idle: it would have imported it by now
    assert spawned() == "True False"
    template.preload(seam.COMPILER)
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


STREAMS = """
import json, random, sys
import numpy as np
import torch
import sympy.core.random as sympy_random
from multiprocessing import current_process
if len(sys.argv) > 1:  # a script that seeds gets exactly the streams it seeds
    torch.manual_seed(1234); np.random.seed(1234); random.seed(1234)
print(json.dumps({
    "torch": [torch.initial_seed(), torch.rand(1).item()],
    "numpy": np.random.rand(),
    "random": random.random(),
    "sympy": sympy_random.rng.random(),
    "authkey": bytes(current_process().authkey).hex(),
}))
"""


def _spawned_json(template: Template, tmp_path: Path, script: Path, *args: str) -> dict:
    out = tmp_path / f"out-{time.monotonic_ns()}.txt"
    proc = template.spawn(
        ["-u", str(script), *args], dict(os.environ), stdout=str(out), stderr=str(out)
    )
    assert proc.wait(60) == 0, out.read_text()
    return json.loads(out.read_text().strip().splitlines()[-1])


def test_forked_workers_draw_fresh_random_streams_and_a_seeded_one_draws_what_it_seeds(
    template: Template, tmp_path: Path
):
    """Every generator a new interpreter seeds from the OS (torch's default one, numpy's
    global state, Python's random, sympy's, which the preloaded compiler imports, the
    multiprocessing authkey) differs from worker to worker as under torchrun; a script
    that seeds draws, bit for bit, what a fresh interpreter draws with that seed."""
    script = tmp_path / "streams.py"
    script.write_text(STREAMS)
    draws = [_spawned_json(template, tmp_path, script) for _ in range(3)]
    for key in ("torch", "numpy", "random", "sympy", "authkey"):
        values = [json.dumps(d[key]) for d in draws]
        assert len(set(values)) == 3, f"{key}: forked workers drew the same numbers: {values}"
    seeded = _spawned_json(template, tmp_path, script, "seed")
    fresh = subprocess.run(
        [sys.executable, str(script), "seed"], capture_output=True, text=True, check=True
    )
    expected = json.loads(fresh.stdout.strip().splitlines()[-1])
    for key in ("torch", "numpy", "random"):
        assert seeded[key] == expected[key], key


ENDS = """
import os, sys
class Witness:
    def __del__(self):
        # a fresh interpreter destroys __main__'s globals while it finalizes (a gloo
        # thread that then asks for the GIL is ended, not waited for)
        print("finalizing", sys.is_finalizing(), flush=True)
witness = Witness()
import __main__
print("main", __main__ is sys.modules["__main__"], __main__.__dict__ is globals(),
      __file__, sys.path[0], os.getsid(0) == os.getpid(), flush=True)
"""


def test_a_forked_workers_script_is_main_until_the_interpreter_finalizes(
    template: Template, tmp_path: Path
):
    """The script runs in the interpreter's own ``__main__`` (runpy's temporary module
    destroyed its globals when it returned: a DDP model then joined gloo's threads
    holding the GIL, and deadlocked), with ``__file__`` absolute but not normalised and
    ``sys.path[0]`` the script's real folder, as Python 3.9+ sets them, in a session
    of its own."""
    (tmp_path / "sub").mkdir()
    script = tmp_path / "ends.py"
    script.write_text(ENDS)
    out = tmp_path / "out.txt"
    proc = template.spawn(
        ["-u", "../ends.py"],
        dict(os.environ),
        cwd=str(tmp_path / "sub"),
        stdout=str(out),
        stderr=str(out),
    )
    assert proc.wait(60) == 0, out.read_text()
    lines = out.read_text().splitlines()
    assert lines == [
        f"main True True {tmp_path}/sub/../ends.py {tmp_path} True",
        "finalizing True",
    ]


COLLECTOR = """
import gc, json, weakref
import torch
class Node:
    pass
node = Node()
node.cycle = node  # garbage only a collection frees
collected = []
ref = weakref.ref(node, lambda _: collected.append(True))
del node
gc.collect()
print(json.dumps({"walked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
                  "collected": collected == [True]}))
"""


def test_a_forked_workers_collections_do_not_walk_the_templates_objects(
    template: Template, tmp_path: Path
):
    """What the template imported (torch, dynamo) is frozen before each fork: the
    worker's collections, and those at its exit, walk only its own objects (walking the
    template's copied every page they touched: 0.8 s of CPU per worker), and its own
    cyclic garbage is collected as in any interpreter."""
    script = tmp_path / "collector.py"
    script.write_text(COLLECTOR)
    seen = _spawned_json(template, tmp_path, script)
    assert seen["collected"], seen
    assert seen["frozen"] > 100_000, seen  # torch's objects, held by the template
    assert seen["walked"] < seen["frozen"] // 5, seen


def test_imports_run_without_the_collector_and_their_objects_are_frozen_after():
    """What the template and the launcher import (torch: 0.6 s of collections) runs
    with the collector off; after, the objects are frozen and the collector is as it
    was."""
    gc_was = gc.isenabled()
    kept = []  # alive to the end: a frozen object freed leaves the frozen count
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            before = gc.get_freeze_count()
            with uncollected():
                assert not gc.isenabled()
                made = [[] for _ in range(1000)]
                kept.append(made)
            assert gc.isenabled() is enabled
            assert gc.get_freeze_count() >= before + len(made)
    finally:
        gc.unfreeze()
        (gc.enable if gc_was else gc.disable)()


def test_a_failing_scripts_traceback_starts_at_the_script(template: Template, tmp_path: Path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.txt"
    proc = template.spawn(
        ["-u", str(script), "raise"], dict(os.environ), stdout=str(out), stderr=str(out)
    )
    assert proc.wait(60) == 1
    text = out.read_text()
    assert 'Traceback (most recent call last):\n  File "' + str(script) in text
    assert "steadfast" not in text.split("Traceback", 1)[1]


def test_when_the_template_may_preload():
    """Once it has served (while workers run: a restart's workers find the modules),
    never while a request may come (not quiet); before serving only on a CUDA build,
    whose probes are forks that run beside the launcher's rendezvous."""
    from steadfast.launcher.preload import Preloader

    cpu, cuda = Preloader([]), Preloader([])
    cpu._probing, cuda._probing = False, True
    for p in (cpu, cuda):
        assert p.idle(quiet=True, running=True, served=True)
        assert p.idle(quiet=True, running=False, served=True)
        assert not p.idle(quiet=False, running=False, served=True)
    assert not cpu.idle(quiet=True, running=False, served=False)
    assert cuda.idle(quiet=True, running=False, served=False)


def test_a_missing_script_ends_as_pythons_does(template: Template, tmp_path: Path):
    out = tmp_path / "out.txt"
    proc = template.spawn(
        ["-u", "nope.py"], dict(os.environ), cwd=str(tmp_path), stdout=str(out), stderr=str(out)
    )
    assert proc.wait(60) == 2
    fresh = subprocess.run(
        [sys.executable, "-u", "nope.py"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.read_text() == fresh.stderr
