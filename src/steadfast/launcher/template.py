"""Worker template: start (and restart) workers by forking a process that has already
imported torch, instead of starting a new interpreter that imports it again.

A new worker pays ~1.2 s for ``import torch`` on every start and every in-job restart.
The launcher starts one *template* process per node that imports torch (without running
any torch operation, so no thread pool or CUDA context exists yet) and then waits for
requests. For each worker it forks a child that becomes a session leader, takes the
worker's environment, argv, and working directory, and runs the training script with
``runpy`` as ``__main__``. The template reaps its children and reports each exit status
to the launcher, which sees the workers through a ``Popen``-like object (pid, poll,
wait) so torch's elastic agent manages them as usual.

Used for ``python [-u] script.py ...`` and ``python [-u] -m module ...`` workers whose
output is not redirected by the launcher (torchrun's ``--redirects`` / ``--tee`` /
``--log-dir``); everything else is started as a new process, as by torchrun.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from .as_main import run_as_main, stdio_as_python
from .fresh import apply_launcher_state, fresh_random_streams, launcher_state
from .preload import Preloader, die_with_parent, uncollected

__all__ = [
    "Template",
    "TemplateProc",
    "IGNORED_SIGNALS",
    "discard_prestarted",
    "keep_prestarted_if",
    "parse_python_argv",
    "prestart",
    "take_prestarted",
]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket) -> dict[str, Any] | None:
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(header)[0])
    return None if body is None else dict(json.loads(body))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def parse_python_argv(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``(kind, target, args)`` for ``python [-u] script.py args`` (kind ``path``) or
    ``python [-u] -m module args`` (kind ``module``); None for anything else."""
    rest = list(argv)
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest[1:]
    return None


# ---------------------------------------------------------------------- template side
def become_worker(request: dict[str, Any]) -> None:
    """In the forked child, at the template's top level: become the process torchrun
    would have started (:mod:`.fresh`) and run its script as ``__main__``
    (:mod:`.as_main`). Returns or raises as the script does; the interpreter's own exit
    follows, as for ``python script.py``."""
    die_with_parent()
    apply_launcher_state(request.get("launcher", {}))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    fresh_random_streams()
    from .boot import worker_hooks

    worker_hooks()  # the end's hooks, and the progress hooks where the launcher asked
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isascii() and threads.isdigit() and int(threads) > 0:
        # what the template's OpenMP read at its import is what torchrun sets for the
        # workers (a prestarted template that would differ is not used); applied again
        # so that the worker's own environment rules its thread count
        import torch

        torch.set_num_threads(int(threads))
    opened: dict[str, int] = {}
    for fd, path in ((1, request.get("stdout")), (2, request.get("stderr"))):
        if path:  # torchrun's --redirects / --log-dir: the worker writes to its file
            if path not in opened:  # one open file (one offset) when both go to one path
                opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened[path], fd)
    for target_fd in opened.values():
        os.close(target_fd)
    # the template runs with -u, as torchrun starts every worker; another request (no
    # -u, no PYTHONUNBUFFERED) gets the stdio a new interpreter would have made
    unbuffered = bool(request.get("unbuffered")) or bool(os.environ.get("PYTHONUNBUFFERED"))
    if not unbuffered:
        stdio_as_python(unbuffered=False)
    sys.orig_argv = [sys.executable, *request.get("argv", ())]
    run_as_main(request["kind"], request["target"], request["args"], os.environ)


#: Signals the template does not act on (its workers get the default actions back): a
#: signal forwarded by srun reaches every process of the step, the template too, and the
#: launcher decides what it means for the workers. One sent by a *worker* to its parent
#: (the template) is passed on to the launcher, the parent it would have under torchrun.
#: The template itself ends when the launcher closes its socket, or by SIGKILL when the
#: launcher dies (PR_SET_PDEATHSIG).
IGNORED_SIGNALS = frozenset(
    getattr(signal, name)
    for name in (
        "SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGTERM",
        "SIGXCPU", "SIGVTALRM", "SIGPROF", "SIGPWR",
    )
    if hasattr(signal, name)
)  # fmt: skip


def serve(fd: int) -> dict[str, Any] | None:
    """The template's main loop (``python -u -m steadfast.launcher.template FD``): None
    when the launcher is gone; in a forked child, the request it is to run, returned to
    the template's top level (:func:`become_worker`), so that the script's end is the
    interpreter's own."""
    import importlib

    from .. import seam

    # Under srun every process of the step gets a forwarded signal (SIGUSR1 of a
    # preemption, say), the template too, even while it imports torch: it must not die
    # of it, or its workers go with it before they can save. The launcher decides.
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()  # the launcher gone -> the template, and then its workers, gone

    with uncollected():
        for name in ("torch", "torch.distributed", "torch.nn.parallel"):
            importlib.import_module(name)
    # what workers import later (dynamo, Inductor's compiler: ~2 s each on 2 cores), so
    # that each restart's workers start without it (see .preload for when); never while
    # forking (the main thread is the only one: no import lock is held at a fork)
    preloader = Preloader(seam.PRELOADED_BY_ALL, seam.PRELOADED_BY_ALL)  # the rest: want()
    preloader.eager()

    # From here on the signals are blocked and read with sigtimedwait (an ignored one is
    # discarded before anyone can see who sent it): a worker's is passed to the launcher
    signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED_SIGNALS)
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)  # never delivered while blocked
    sock = socket.socket(fileno=fd)
    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)  # `python -m` put the launcher's cwd first; a worker puts its own
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    # readable while one of the blocked signals is pending: no polling for them
    signals = _signal_fd(IGNORED_SIGNALS)
    if signals is not None:
        sel.register(signals, selectors.EVENT_READ)
    try:
        _send(sock, {"ready": os.getpid()})
    except OSError:  # the launcher closed it while we imported torch (not needed)
        return None
    template = os.getpid()
    try:
        asked = time.monotonic()  # the last request (a group's come one after another)
        served = False
        while True:
            # idle, the template sleeps until a request, a child's end or a signal
            polling = signals is None or preloader.pending()
            ready = sel.select(_SIGNAL_POLL if polling else None)
            if not ready and preloader.pending():
                quiet = time.monotonic() - asked >= _PRELOAD_IDLE
                preloader.poll(preloader.idle(quiet, bool(children), served))
            for key, _ in ready:
                if key.fileobj == wake_r:
                    os.read(wake_r, 512)
                    _reap(sock, children)
                    continue
                if key.fileobj == signals:  # read by _pass_on_workers_signals below
                    continue
                request = _recv(sock)
                if request is None:  # the launcher is gone
                    return None
                if "preload" in request:  # the job needs it (Template.preload)
                    preloader.want(str(request["preload"]))
                    continue
                asked, served = time.monotonic(), True
                synced_r, synced_w = os.pipe()
                # what the template holds (torch, dynamo: ~290,000 objects) goes to the
                # collector's permanent generation, which no collection visits: else a
                # worker's collections, and the two at its interpreter's exit, walk
                # all of it and copy every page they touch (0.8 s of CPU per worker of
                # a trivial script; Python's documented pre-fork recipe). O(1), and
                # the same set each time but for what came since the last fork.
                gc.freeze()
                pid = os.fork()
                if pid == 0:
                    # a session of its own, as torch's Popen(start_new_session=True)
                    # gives, before the template tells anyone its pid
                    os.setsid()
                    os.close(synced_w)
                    os.close(synced_r)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    if signals is not None:
                        os.close(signals)
                    return request
                os.close(synced_w)
                os.read(synced_r, 1)  # EOF once the child has its session (or is gone)
                os.close(synced_r)
                children.add(pid)
                _send(sock, {"spawned": pid, "id": request["id"]})
            _reap(sock, children)
            _pass_on_workers_signals(children)
    finally:
        if os.getpid() == template:  # not in a child on its way to run a script
            _end_children(preloader, children)


def _end_children(preloader: Preloader, children: set[int]) -> None:
    """The template's end: its probe and every worker still running killed and reaped."""
    preloader.close()
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    while children:
        with contextlib.suppress(ChildProcessError):
            pid, _ = os.wait()
            children.discard(pid)


#: How often the template looks for a signal a worker sent it (seconds) where it has no
#: signalfd, and for its preloads' progress while they are pending.
_SIGNAL_POLL = 0.05


def _signal_fd(signals: frozenset[int]) -> int | None:
    """A Linux signalfd readable while one of ``signals`` (blocked) is pending, so the
    template sleeps until one comes instead of looking every :data:`_SIGNAL_POLL` (20
    wake-ups a second, 0.24 % of a core here); None where there is none (then it
    polls). The signals themselves are still taken with ``sigtimedwait``, which tells
    who sent each."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        mask = bytearray(128)  # glibc's sigset_t: 1024 bits
        for sig in signals:
            mask[(sig - 1) // 8] |= 1 << ((sig - 1) % 8)
        buffer = (ctypes.c_char * len(mask)).from_buffer(mask)
        fd = int(libc.signalfd(-1, buffer, os.O_NONBLOCK | os.O_CLOEXEC))
    except (OSError, AttributeError):
        return None
    return fd if fd >= 0 else None


#: Seconds without a request before the template imports the next preloaded module:
#: a group's workers are asked for one after another, ms apart, and must not be split
#: by an import (one worker started 1.6 s after the other).
_PRELOAD_IDLE = 0.25


def _pass_on_workers_signals(children: set[int]) -> None:
    """Pass each pending signal that one of ``children`` (a worker) sent to the launcher
    (this process's parent); drop the others (srun's, sent to the whole step: the
    launcher got its own)."""
    while True:
        info = signal.sigtimedwait(IGNORED_SIGNALS, 0)
        if info is None:
            return
        if info.si_pid in children:
            with contextlib.suppress(OSError):
                os.kill(os.getppid(), info.si_signo)


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):  # by pid: a preload's probe is the Preloader's to reap
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its status is lost, not its end
            children.discard(pid)
            with contextlib.suppress(OSError):
                _send(sock, {"exited": pid, "code": 1})
            continue
        if done == 0:
            continue
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with contextlib.suppress(OSError):
            _send(sock, {"exited": pid, "code": code})


# ---------------------------------------------------------------------- launcher side
class TemplateProc:
    """The ``Popen`` subset torch's agent uses (pid, poll, wait, returncode) for a worker
    forked by the template; the exit status comes from the template."""

    def __init__(self, template: Template, pid: int) -> None:
        self._template = template
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the worker ended (negative: killed by that signal)."""
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the worker to end, like ``Popen.wait``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("template worker", timeout or 0.0)
            self._template.wait_for_exit(0.05)
        assert self.returncode is not None
        return self.returncode


class Template:
    """The launcher's handle on the template process."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        parent, child = socket.socketpair()
        self._sock = parent
        #: the environment the template imported torch with (OpenMP reads it then)
        self.env = dict(os.environ if env is None else env)
        self._proc = subprocess.Popen(
            # -u: the stdio every worker of torchrun's has (it starts them `python -u`)
            [sys.executable, "-u", "-m", "steadfast.launcher.template", str(child.fileno())],
            pass_fds=(child.fileno(),),
            start_new_session=True,
            env=self.env,
        )
        child.close()
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._spawned: dict[int, int] = {}
        self._workers: set[int] = set()  # every worker's pid (its exit is in _exits)
        self._next_id = 0
        self._ready = threading.Event()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="steadfast-template", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = _recv(self._sock)
            except OSError:
                message = None
            with self._cond:
                if message is None:
                    self._closed = True
                    self._cond.notify_all()
                    self._ready.set()
                    return
                if "ready" in message:
                    self._ready.set()
                elif "spawned" in message:
                    pid = int(message["spawned"])
                    self._exits.pop(pid, None)  # a recycled pid: the old exit is not this one
                    self._spawned[int(message["id"])] = pid
                    self._workers.add(pid)
                elif "exited" in message:
                    self._exits[int(message["exited"])] = int(message["code"])
                self._cond.notify_all()

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None = None,
        stdout: str | None = None,
        stderr: str | None = None,
    ) -> TemplateProc:
        """Fork a worker running ``python argv...`` with ``env`` (output to the given
        files, else inherited)."""
        parsed = parse_python_argv(argv)
        if parsed is None:
            raise ValueError(f"not a python script or module command line: {argv}")
        kind, target, args = parsed
        if not self.ready(600):
            raise RuntimeError("the worker template process is not running")
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            _send(
                self._sock,
                {
                    "id": request_id,
                    "kind": kind,
                    "target": target,
                    "args": args,
                    "env": env,
                    "cwd": cwd or os.getcwd(),
                    "stdout": stdout,
                    "stderr": stderr,
                    "argv": argv,
                    "unbuffered": "-u" in argv[: len(argv) - len(args)],
                    "launcher": launcher_state(),
                },
            )
        with self._cond:
            while request_id not in self._spawned:
                if self._closed:
                    raise RuntimeError("the worker template process exited")
                self._cond.wait(1.0)
            pid = self._spawned.pop(request_id)
        return TemplateProc(self, pid)

    def preload(self, name: str) -> None:
        """Have the template import ``name`` (one of :data:`steadfast.seam.PRELOADED`)
        for the workers it forks from now on, when it is idle; not waited for."""
        with self._lock, contextlib.suppress(OSError):
            _send(self._sock, {"preload": name})

    def ready(self, timeout: float) -> bool:
        """Whether the template has imported torch and serves requests (waits up to
        ``timeout`` seconds)."""
        return self._ready.wait(timeout) and not self._closed

    def exit_code(self, pid: int) -> int | None:
        """The worker's exit code, or None while it runs."""
        with self._cond:
            code = self._exits.get(pid)
            if code is None and self._closed:
                return -signal.SIGKILL  # the template is gone, and its workers with it
            return code

    def wait_for_exit(self, timeout: float) -> None:
        """Block until some worker exits or ``timeout`` passes."""
        with self._cond:
            self._cond.wait(timeout)

    def close(self) -> None:
        """Stop the template (it kills any worker still running) and wait for it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._cond:  # every worker's exit seen: nothing left for it to stop
            idle = self._workers.issubset(self._exits)
        # still importing torch, or a preload (seconds it cannot be woken from): nothing
        # of it is needed
        if not self._ready.is_set() or idle:
            self._proc.kill()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)


_prestarted: Template | None = None


def prestart() -> None:
    """Start the template now, before the launcher imports torch itself, so that the two
    imports (~2-3 s each) run side by side instead of one after the other. The agent
    takes it with :func:`take_prestarted`; :func:`discard_prestarted` closes it when
    nothing took it (``worker_template: false``, an error before the agent).

    Its environment is the launcher's with ``OMP_NUM_THREADS=1`` when unset: what
    torchrun sets for more than one worker per node. When the launcher ends up with
    another value (one worker per node), :func:`keep_prestarted_if` drops it."""
    global _prestarted
    if _prestarted is None:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        _prestarted = Template(env=env)


def keep_prestarted_if(omp_num_threads: str | None) -> None:
    """Close the prestarted template unless it imported torch with this
    ``OMP_NUM_THREADS`` (the launcher's, once torchrun's settings are applied): OpenMP
    and BLAS size their thread pools from the environment at import."""
    if _prestarted is not None and _prestarted.env.get("OMP_NUM_THREADS") != omp_num_threads:
        discard_prestarted()


def take_prestarted() -> Template | None:
    """The template :func:`prestart` started, now owned by the caller (or None)."""
    global _prestarted
    template, _prestarted = _prestarted, None
    return template


def discard_prestarted() -> None:
    """Close a prestarted template that nothing took."""
    template = take_prestarted()
    if template is not None:
        template.close()


if __name__ == "__main__":
    _request = serve(int(sys.argv[1]))
    if _request is None:
        # nothing of the template needs finalising (its workers are reaped): skip the
        # interpreter's teardown of torch (~0.4 s the launcher would wait for at its end)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)
    # a forked worker: its script runs here, at the top level, and the interpreter's
    # own exit follows (module teardown while finalizing, as for `python script.py`)
    become_worker(_request)
    del _request
