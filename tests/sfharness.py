"""Test harness: run a function on N real processes joined in a gloo process group.

Each rank is a real OS process, the group is real (gloo over a FileStore in the test's
tmp dir), and results or tracebacks come back through files, so a rank that is killed or
hangs is seen as such. The ranks are forked by steadfast's own worker template (the
process ``steadfast launch`` forks its workers from): one per test session, started by
``tests/conftest.py``, that imported torch once, so a rank does not pay ``import torch``
(2-3 s here) again. Without it (``SFHARNESS_FRESH=1``, or no session template) each rank
is a fresh interpreter started with subprocess.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import pickle
import re
import secrets
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from steadfast.shm import TAG_ENV

_HERE = str(Path(__file__).resolve().parent)
_template: Any = None  # the session's steadfast.launcher.template.Template


def start_template() -> int | None:
    """Start the session's rank template (the conftest does, before the first test, so
    that its process, thread and socket are there before every test's leak check
    looks); its pid."""
    global _template
    if _template is None and not os.environ.get("SFHARNESS_FRESH"):
        from steadfast.launcher.template import Template

        _template = Template()
    return template_pid()


def template_pid() -> int | None:
    """The session template's pid (its children are the ranks), or None."""
    return int(_template._proc.pid) if _template is not None else None


def stop_template() -> None:
    global _template
    if _template is not None:
        _template.close()
        _template = None


def children(pid: int, zombies: bool = False) -> set[int]:
    """The child processes of ``pid`` (zombies too when ``zombies``: an unreaped child
    is a leak of its parent)."""
    kids: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and (zombies or fields[0] != "Z"):
            kids.add(int(entry))
    return kids


#: This session's tag (``steadfast.shm``): every launcher, worker and test of the
#: session makes its /dev/shm entries under it, so that the leak check counts only them
#: and never a neighbour job's live segments. Set before the session's first process.
if __name__ == "__main__" and TAG_ENV in os.environ:  # a rank of the session: its tag
    SUITE_TAG = os.environ[TAG_ENV]
else:
    SUITE_TAG = f"suite{os.getpid()}{secrets.token_hex(3)}"
    os.environ[TAG_ENV] = SUITE_TAG


def suite_shm(pattern: str = "steadfast-*") -> set[str]:
    """The entries of ``/dev/shm`` matching ``pattern`` that this session made."""
    return {p.name for p in Path("/dev/shm").glob(pattern) if f"-{SUITE_TAG}-" in f"{p.name}-"}


#: Every rank process the harness started in this session: the leak check attributes a
#: /dev/shm entry named after one of them to the test, after the rank is gone too.
SPAWNED: set[int] = set()


def shm_entries() -> set[str]:
    """The names in ``/dev/shm`` now."""
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def shm_leaks(before: set[str], pids: set[int]) -> set[str]:
    """The ``/dev/shm`` entries made since ``before`` that this test's processes made:
    steadfast's names that carry this session's tag (:data:`SUITE_TAG`, whichever of its
    processes made them), and names that embed one of ``pids`` as a number (torch's
    ``torch_<pid>_<n>``; the caller passes the test's process, its live children and the
    harness's ranks, :data:`SPAWNED`). Entries of other programs on a busy machine (a
    neighbour's steadfast job, multiprocessing's ``sem.mp-*`` of an unrelated one) are not
    the test's, and do not fail it."""
    mine = {str(p) for p in pids}
    ours = suite_shm()
    return {
        name
        for name in shm_entries() - before
        if name in ours or (not name.startswith("steadfast-") and mine & _numbers(name))
    }


def _numbers(name: str) -> set[str]:
    """The whole numbers in ``name`` (``torch_812_3`` holds 812 and 3; the hex
    ``8d772c8a`` holds none)."""
    return set(re.findall(r"(?<![0-9A-Za-z])\d+(?![0-9A-Za-z])", name))


def socket_count() -> int:
    """How many sockets this process has open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def processes_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text`` (a test's tmp path):
    grandchildren, and processes under slurmstepd, that the leak check cannot see."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


def assert_none_left(text: str, timeout: float = 10.0) -> None:
    """Fail unless every process whose command line mentions ``text`` (a test's tmp
    path) is gone within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of this test still running: {left}"


@contextlib.contextmanager
def refusing_fence(answer: str) -> Iterator[str]:
    """A launcher's fence (``steadfast.fence``) that answers its one caller ``answer``
    (e.g. ``fenced: ...``); yields the address to put in ``$STEADFAST_FENCE``."""
    import socket
    import threading

    name = f"steadfast-test-fence-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)

    def reply() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.recv(16)
                conn.sendall(answer.encode() + b"\n")

    responder = threading.Thread(target=reply, name="refusing-fence")
    responder.start()
    try:
        yield "@" + name
    finally:
        with contextlib.suppress(OSError):  # wakes an accept still waiting for a caller
            listener.shutdown(socket.SHUT_RDWR)
        responder.join(5)
        listener.close()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` so that a reader polling ``path`` never sees it empty or partial
    (``write_text`` truncates first): a temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


#: the quick tier's measurement (scripts/quick_tier.py) sets it: the id of the test whose
#: coverage a process records (tests/conftest.py sets it at each test's setup)
COV_CONTEXT_ENV = "STEADFAST_COV_CONTEXT"


def cover_as(context: str) -> None:
    """Record this process's coverage from now on under ``context`` (a test's id), where
    coverage.py measures it."""
    import coverage

    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(context)


def _cover_as_the_test() -> None:
    """A rank forked by the session's template covers code under the test that asked for
    it (the template's coverage started under the session's first test)."""
    context = os.environ.get(COV_CONTEXT_ENV)
    if context:
        cover_as(context)


#: :meth:`Ranks.wait` sends it to a rank that outlives its bound: the rank's faulthandler
#: writes every thread's stack to ``stacks_<rank>.txt`` (a real-time signal: none of
#: steadfast's or torch's)
STACKS_SIGNAL = signal.SIGRTMIN + 3
_stacks_file: Any = None


def _dump_stacks_on_signal(workdir: str, rank: int) -> None:
    global _stacks_file
    _stacks_file = open(Path(workdir) / f"stacks_{rank}.txt", "w")  # noqa: SIM115 (kept open)
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True, chain=False)


def _rank_main(workdir: str, rank: int, world_size: int) -> None:
    """Entry point of one rank process (``python sfharness.py WORKDIR RANK WORLD``)."""
    _cover_as_the_test()
    _dump_stacks_on_signal(workdir, rank)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    import torch.distributed as dist

    out = Path(workdir) / f"result_{rank}.pkl"
    write_atomic(Path(workdir) / f"pid_{rank}", str(os.getpid()))
    code = 0
    try:
        module, name, args, module_dir = pickle.loads((Path(workdir) / "call.pkl").read_bytes())
        for path in (module_dir, _HERE):  # a forked rank did not read PYTHONPATH
            if path not in sys.path:
                sys.path.insert(0, path)
        fn = getattr(importlib.import_module(module), name)
        if not os.environ.get("SFHARNESS_NO_INIT"):  # else fn initialises it itself
            dist.init_process_group(
                "gloo",
                init_method=f"file://{workdir}/store",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=60),
            )
        result: Any = ("ok", fn(rank, world_size, Path(workdir), *args))
    except BaseException:
        result = ("error", traceback.format_exc())
        code = 1
    out.write_bytes(pickle.dumps(result))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Ranks:
    """``world_size`` processes running ``fn(rank, world_size, workdir, *args)``.

    ``fn`` must be a module-level function of an importable module (a test module is).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        workdir: Path,
        world_size: int = 2,
        args: tuple[Any, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        module_dir = str(Path(sys.modules[fn.__module__].__file__ or _HERE).resolve().parent)
        call = (fn.__module__, fn.__name__, args, module_dir)
        (self.workdir / "call.pkl").write_bytes(pickle.dumps(call))
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env["PYTHONPATH"] = os.pathsep.join(
            [_HERE, module_dir, *filter(None, [child_env.get("PYTHONPATH")])]
        )
        argv = [__file__, str(self.workdir)]  # the script and its arguments
        self.procs: list[Any] = [
            _template.spawn([*argv, str(r), str(world_size)], child_env)
            if _template is not None
            else subprocess.Popen([sys.executable, *argv, str(r), str(world_size)], env=child_env)
            for r in range(world_size)
        ]
        SPAWNED.update(p.pid for p in self.procs)

    def pid(self, rank: int, timeout: float = 30.0) -> int:
        path = self.workdir / f"pid_{rank}"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} never started")
            time.sleep(0.01)
        return int(path.read_text())

    def wait(self, timeout: float = 90.0) -> list[int | None]:
        deadline = time.monotonic() + timeout
        hung = []
        for rank, p in enumerate(self.procs):
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(rank)
        stacks = self._stacks(hung)
        self.kill()
        if hung:
            raise TimeoutError(f"ranks still running after {timeout}s: {hung}\n{stacks}")
        return [p.returncode for p in self.procs]

    def _stacks(self, ranks: list[int]) -> str:
        """Every thread's Python stack in each of ``ranks``, still running (see
        :data:`STACKS_SIGNAL`)."""
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[rank].pid, STACKS_SIGNAL)
        texts = []
        for rank in ranks:
            path = self.workdir / f"stacks_{rank}.txt"
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and not (path.exists() and path.stat().st_size):
                time.sleep(0.05)
            time.sleep(0.2)  # the rest of the dump
            text = path.read_text(errors="replace") if path.exists() else "(no dump)"
            texts.append(f"--- rank {rank} ---\n{text}")
        return "\n".join(texts)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            p.wait(10)

    def results(self) -> list[Any]:
        """Each rank's return value; raises with the rank's traceback if it failed."""
        out = []
        for r in range(len(self.procs)):
            path = self.workdir / f"result_{r}.pkl"
            if not path.exists():
                raise AssertionError(f"rank {r} left no result (killed?)")
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{value}")
            out.append(value)
        return out


def run_ranks(
    fn: Callable[..., Any],
    workdir: Path,
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 90.0,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks and return their results (rank order)."""
    ranks = Ranks(fn, workdir, world_size, args, env)
    ranks.wait(timeout)
    return ranks.results()


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


def launch_run(workdir: Path, *args: str, timeout: float = 240) -> tuple[int, list[dict[str, Any]]]:
    """One ``steadfast launch ARGS`` (launcher flags, the script and its arguments) with
    its event log in ``workdir/events.jsonl``: (exit status, the events). The output's
    tail is printed when it fails, for the test's report."""
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "events.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "launch", "--events", str(events), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:])
    return done.returncode, read_events(events)


def run_report(workdir: Path) -> tuple[dict[str, Any], str]:
    """``steadfast report`` of ``workdir/events.jsonl``: (its ``--json``, its text)."""

    def run(*flags: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "steadfast.cli", "report", *flags, "--no-timeline",
             str(workdir / "events.jsonl")],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip

    return json.loads(run("--json")), run()


def assert_bit_exact(out: Path, reference: dict[str, Any]) -> None:
    """The parameters a run saved in ``out`` equal ``reference`` bit for bit."""
    import torch

    got = torch.load(out)
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got[name], value), f"{name} differs from the fault-free run"


def fork_when_ready(loop: Callable[[Callable[[], None]], None]) -> int:
    """Fork a process that runs ``loop(ready)`` until it is killed; return its pid once
    it called ``ready()``. Forked from this process (torch already imported): a test
    killing it 30 times pays no import. The fork runs torch ops on one thread: the
    parent's OpenMP threads do not exist in it, and a parallel op there can hang."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns, it is killed
        try:
            os.close(ready_r)
            import torch

            torch.set_num_threads(1)
            loop(lambda: os.write(ready_w, b"1") and None)
        finally:
            os._exit(1)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
    finally:
        os.close(ready_r)
    return pid


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # a log being written: its last line may be a write still under way (one os.write
    # of a line across a page boundary is seen in two parts), which the next read has
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))


def join_rendezvous(*handlers: Any) -> dict[str, Any]:
    """Every rendezvous handler's ``next_rendezvous`` at once, each on a thread (as
    every node's agent calls it): node -> ``(rank, world size)``, or the exception it
    raised (without its traceback: no frames, and no store clients, kept alive)."""
    import threading

    out: dict[str, Any] = {}

    def run(h: Any) -> None:
        try:
            info = h.next_rendezvous()
            out[h.node] = (info.rank, info.world_size)
        except Exception as exc:  # the test looks at it
            out[h.node] = exc.with_traceback(None)

    threads = [threading.Thread(target=run, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@contextlib.contextmanager
def started_probe() -> Iterator[Any]:
    """A progress probe (steadfast.progress) started in this process on a fresh one-row
    heartbeat table, as a worker has it; closed (its hooks removed) on exit."""
    from steadfast.monitor.table import HeartbeatTable, ask_path
    from steadfast.progress.probe import Probe

    table = HeartbeatTable.create(rows=1)
    table.reset(0, {}, None, None, None)
    probe = Probe(table, 0, str(ask_path(table.path, 0)))
    probe.start()
    try:
        yield probe
    finally:
        probe.close()
        table.close()


def enter_round(rosters: list[Any], stores: list[Any], run_id: str = "job") -> None:
    """Every node roster enters the same round at once (node rank = its index), as the
    launchers do after a rendezvous."""
    import threading

    threads = [
        threading.Thread(target=r.enter_round, args=(s, i, len(rosters), run_id, None))
        for i, (r, s) in enumerate(zip(rosters, stores, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
