"""Contract tests of steadfast.seam: one per private of torch (or Python) that steadfast
touches, run the way steadfast uses it. A torch upgrade that breaks a touch point fails
the test named after it."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig

from steadfast import seam


def test_terminate_process_handler_raises_signal_exception() -> None:
    handler = seam.terminate_process_handler()
    before = signal.signal(signal.SIGUSR2, handler)
    try:
        with pytest.raises(SignalException) as info:
            os.kill(os.getpid(), signal.SIGUSR2)
            signal.sigtimedwait([], 0)  # let the handler run
        assert info.value.sigval == signal.SIGUSR2
    finally:
        signal.signal(signal.SIGUSR2, before)


class _Recording(LocalElasticAgent):
    """torch's agent with its protected hooks recorded, using the seam's touch points
    as FTAgent does."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[str] = []
        self.pids: list[dict[int, int]] = []
        self.remaining: list[int] = []
        self.started_by: list[str] = []

    def _rendezvous(self, worker_group: Any) -> None:
        self.calls.append("rendezvous")
        super()._rendezvous(worker_group)

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        self.calls.append("start")

        def start_processes(**kwargs: Any) -> Any:
            self.started_by.append("replacement")
            return original(**kwargs)

        with seam.start_processes_from(start_processes) as original:
            ids = super()._start_workers(worker_group)
        self.pids.append(dict(seam.agent_pcontext(self).pids()))
        self.remaining.append(seam.agent_remaining_restarts(self))
        return ids  # type: ignore[no-any-return]

    def _stop_workers(self, worker_group: Any) -> None:
        self.calls.append("stop")
        seam.agent_shutdown(self, signal.SIGTERM, 5)

    def _monitor_workers(self, worker_group: Any) -> Any:
        result = super()._monitor_workers(worker_group)
        if result.state != WorkerState.HEALTHY:
            self.calls.append(f"monitor:{result.state.name}")
        return result

    def _restart_workers(self, worker_group: Any) -> None:
        self.calls.append("restart")
        super()._restart_workers(worker_group)

    def _exit_barrier(self) -> None:
        self.calls.append(f"exit_barrier:{seam.agent_exit_barrier_timeout(self):g}")


def _launch(tmp_path: Any, code: str, max_restarts: int) -> tuple[list[_Recording], Any]:
    agents: list[_Recording] = []
    received: list[set[str]] = []

    def factory(**kwargs: Any) -> _Recording:
        received.append(set(kwargs))
        agents.append(_Recording(**kwargs))
        return agents[-1]

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        **(
            {"shutdown_timeout": 5}
            if "shutdown_timeout" in LaunchConfig.__dataclass_fields__
            else {}
        ),
    )
    old = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        result = seam.launch_agent(factory, config, sys.executable, ["-c", code])
    except ChildFailedError as exc:
        result = exc
    finally:
        if old is not None:
            os.environ["TORCHELASTIC_ERROR_FILE"] = old
    assert received and {"spec", "logs_specs", "start_method"} <= received[0]
    return agents, result


def _release(agents: list[_Recording]) -> None:
    """Drop the agents and with them the rendezvous store they hold (its sockets)."""
    agents.clear()
    gc.collect()


def test_launch_agent_builds_the_agent_and_runs_its_hooks(tmp_path: Any) -> None:
    """torch's launch_agent takes the agent from the factory; a failed worker group is
    restarted through _restart_workers -> _stop_workers -> _rendezvous ->
    _start_workers (started with the swapped start_processes), with one restart fewer;
    a group that fails with none left raises ChildFailedError."""
    marker = tmp_path / "ran-once"
    code = textwrap.dedent(
        f"""
        import os, sys
        if not os.path.exists({str(marker)!r}):
            open({str(marker)!r}, "w").close()
            sys.exit(3)
        """
    )
    agents, result = _launch(tmp_path, code, max_restarts=1)
    assert len(agents) == 1 and not isinstance(result, ChildFailedError)
    agent = agents[0]
    assert agent.calls == [
        "rendezvous",
        "start",
        "monitor:FAILED",
        "restart",
        "stop",
        "rendezvous",
        "start",
        "monitor:SUCCEEDED",
        "exit_barrier:300",  # after a success, with torch's exit_barrier_timeout
    ]
    assert agent.started_by == ["replacement", "replacement"]
    assert agent.remaining == [1, 0]
    assert all(len(p) == 1 and next(iter(p.values())) > 0 for p in agent.pids)

    agents, result = _launch(tmp_path, "import sys; sys.exit(5)", max_restarts=0)
    assert isinstance(result, ChildFailedError)
    assert [f.exitcode for f in result.failures.values()] == [5]
    _release(agents)
    del agent, result
    gc.collect()


def test_subprocess_context_start_override(tmp_path: Any) -> None:
    """A SubprocessContext whose _start fills subprocess_handlers (objects with proc and
    close) is polled, listed and closed by torch's own code."""
    base: Any = seam.subprocess_context_type()

    class Handler:
        def __init__(self, argv: list[str]) -> None:
            self.proc = subprocess.Popen(argv)

        def close(self, death_sig: signal.Signals | None = None) -> None:
            self.proc.send_signal(death_sig or signal.SIGTERM)

    started: list[int] = []

    class Context(base):  # type: ignore[misc]
        def _start(self) -> None:
            started.append(self.nprocs)
            self.subprocess_handlers = {
                r: Handler([self.entrypoint, *map(str, self.args[r])]) for r in range(self.nprocs)
            }

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

    logs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.NONE, tee=Std.NONE)
    ctx = Context(
        name="contract",
        entrypoint=sys.executable,
        args={0: ("-c", "import sys; sys.exit(4)"), 1: ("-c", "import time; time.sleep(60)")},
        envs={0: {}, 1: {}},
        logs_specs=logs,
    )
    ctx.start()
    try:
        assert started == [2]
        pids = ctx.pids()
        assert set(pids) == {0, 1} and all(p > 0 for p in pids.values())
        result = ctx.wait(timeout=30, period=0.05)
        assert result is not None and result.is_failed()
        assert result.failures[0].exitcode == 4
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert ctx.subprocess_handlers[1].proc.poll() is not None


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_process_groups_and_abort_all() -> None:
    """process_groups lists the live groups oldest first; abort_all_process_groups
    aborts them and clears the registry, so init_process_group can run again."""
    done = _run_python(
        """
        import os, tempfile
        import torch.distributed as dist
        from steadfast import seam
        path = tempfile.mktemp()
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        sub = dist.new_group([0])
        groups = seam.process_groups()
        assert groups == [dist.group.WORLD, sub], groups
        seam.abort_all_process_groups()
        assert not dist.is_initialized()
        assert seam.process_groups() == []
        dist.init_process_group("gloo", init_method=f"file://{path}.2", rank=0, world_size=1)
        assert dist.is_initialized()
        dist.destroy_process_group()
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert not dist.is_initialized()


def test_process_group_stores() -> None:
    """process_group_stores gives the store each live group was made with; under a
    PrefixStore the TCPStore's port is found (the abort keeps those connections)."""
    done = _run_python(
        """
        import socket
        from datetime import timedelta
        import torch.distributed as dist
        from steadfast import seam
        from steadfast.inprocess import transport
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
        dist.init_process_group("gloo", store=dist.PrefixStore("it0", store), rank=0, world_size=1)
        dist.new_group([0])
        stores = seam.process_group_stores()
        assert len(stores) >= 1, stores
        assert transport.store_ports(stores) == {port}, transport.store_ports(stores)
        dist.destroy_process_group()
        assert seam.process_group_stores() == []
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_option_actions() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--with-value", "--with_value")
    parser.add_argument("--flag", action="store_true")
    actions = seam.option_actions(parser)
    assert actions["--with-value"] is actions["--with_value"]
    assert actions["--with-value"].nargs is None and actions["--flag"].nargs == 0


def test_run_module_as_main_runs_in_the_interpreters_own_main(tmp_path: Path) -> None:
    """``runpy._run_module_as_main``: the module runs in ``sys.modules["__main__"]``'s
    own dict (which stays), with ``sys.argv[0]`` its file, as ``python -m`` runs it."""
    (tmp_path / "mod_for_seam.py").write_text(
        "import sys\nvalue = 42\nprint(sys.argv[0].endswith('mod_for_seam.py'), __name__)\n"
    )
    done = _run_python(
        f"""
        import sys, types
        from steadfast import seam
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        sys.path.insert(0, {str(tmp_path)!r})
        sys.argv = ["-m"]
        seam.run_module_as_main("mod_for_seam")
        print(sys.modules["__main__"] is main, main.value)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "__main__", "True", "42"]


def test_interpreter_exit_joins_threads_then_runs_atexit() -> None:
    done = _run_python(
        """
        import atexit, os, sys, threading, time
        from steadfast import seam
        atexit.register(lambda: print("atexit", flush=True))
        def work():
            time.sleep(0.2)
            print("thread", flush=True)
        threading.Thread(target=work).start()
        seam.interpreter_exit()
        sys.stdout.flush()
        os._exit(0)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["thread", "atexit"]


# ------------------------------------------------------------------ dynamic rendezvous
def _handlers(n: int, run_id: str, **conf: Any) -> list[Any]:
    """n handlers of one c10d rendezvous (min = max = 2), the first hosting the store."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    port = _free_port()
    out = []
    for i in range(n):
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{port}",
            run_id=run_id,
            min_nodes=2,
            max_nodes=2,
            local_addr="127.0.0.1",
            is_host=i == 0,
            keep_alive_interval=600,  # no keep-alive, and no expiry, during the test
            join_timeout=60,
            last_call_timeout=1,
            **conf,
        )
        out.append(rdzv_registry.get_rendezvous_handler(params))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_all(handlers: list[Any]) -> list[Any]:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def _close(handlers: list[Any]) -> None:
    for h in handlers:
        h.shutdown()
    handlers.clear()
    gc.collect()


def test_expire_rendezvous_nodes_lets_a_spare_replace_a_lost_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A and B form round 0; B is "lost" (its keep-alive would not expire for 30 min);
    once A expires it, A and the spare C complete the next round at once."""
    # as steadfast launch runs it (see launcher/__init__.py): a store of the workers' own
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handlers = _handlers(3, str(uuid.uuid4()))
    a, b, c = handlers
    try:
        infos = _join_all([a, b])
        assert sorted(i.rank for i in infos) == [0, 1] and infos[0].world_size == 2
        ids = [seam.rendezvous_node_id(h) for h in (a, b, c)]
        assert all(isinstance(i, list) and len(i) == 3 for i in ids)
        assert len({tuple(i) for i in ids if i}) == 3
        assert seam.expire_rendezvous_nodes(a, [ids[1]]) == 1
        assert seam.expire_rendezvous_nodes(a, [ids[1]]) == 0  # gone already
        infos = _join_all([a, c])
        assert sorted(i.rank for i in infos) == [0, 1] and infos[0].world_size == 2
    finally:
        _close(handlers)


def test_rendezvous_round_is_the_number_in_the_rounds_store_prefix() -> None:
    """The round a handler joined names the keys of the store it handed out, the same
    on every node, and moves on with the next round (the roster seals with it)."""
    run_id = str(uuid.uuid4())
    handlers = _handlers(2, run_id)
    try:
        for _ in range(2):  # the first round, then the next one after both leave it
            infos = _join_all(handlers)
            (number,) = {seam.rendezvous_round(h) for h in handlers}
            assert isinstance(number, int)
            infos[0].store.set("probe", "1")
            base = infos[0].store.underlying_store
            assert base.check([f"torch.rendezvous.{run_id}.{number}/probe"])
        assert number >= 1
    finally:
        _close(handlers)


def test_rendezvous_join_timeout_bounds_one_join() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    handlers = _handlers(1, str(uuid.uuid4()))
    (alone,) = handlers
    try:
        before = alone.settings.timeout.join
        with seam.rendezvous_join_timeout(alone, 1.0):
            assert alone.settings.timeout.join.total_seconds() == 1.0
            with pytest.raises(RendezvousTimeoutError):
                alone.next_rendezvous()  # min_nodes=2: nobody else comes
        assert alone.settings.timeout.join == before
    finally:
        _close(handlers)


def test_rendezvous_touch_points_ignore_other_handlers() -> None:
    class Other:
        pass

    other = Other()
    assert seam.rendezvous_node_id(other) is None
    assert seam.rendezvous_round(other) is None
    assert seam.expire_rendezvous_nodes(other, [["x", 1, 0]]) == 0
    with seam.rendezvous_join_timeout(other, 1.0):
        pass


def test_foreach_inf_norms_is_one_fused_kernel_that_propagates_nan() -> None:
    """foreach_inf_norms uses torch._foreach_norm (present in every supported torch) and
    gives each tensor's infinity norm, a NaN or an Inf anywhere in a tensor included."""
    import math

    import torch

    assert callable(getattr(torch, "_foreach_norm", None))
    tensors = [
        torch.tensor([1.0, -3.0, 2.0]),
        torch.tensor([0.5, float("nan"), 9.0]),
        torch.tensor([[float("-inf"), 1.0]]),
        torch.zeros(4),
    ]
    norms = seam.foreach_inf_norms(tensors)
    assert len(norms) == 4 and all(n.dim() == 0 for n in norms)
    assert float(norms[0]) == 3.0
    assert math.isnan(float(norms[1]))
    assert float(norms[2]) == math.inf
    assert float(norms[3]) == 0.0


def test_foreach_copy_copies_every_tensor_in_one_call_without_autograd() -> None:
    """foreach_copy uses torch._foreach_copy_ (present in every supported torch): each
    source lands in its destination, bit for bit, across dtypes, shapes, a 0-d tensor
    and a non-contiguous view; under no_grad a parameter's copy is not in any graph."""
    import torch

    assert callable(getattr(torch, "_foreach_copy_", None))
    param = torch.nn.Parameter(torch.randn(3, 4))
    srcs = [
        param,
        torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # non-contiguous
        torch.tensor(7.5, dtype=torch.float64),  # 0-d, as an optimizer's step
        torch.randn(5).to(torch.bfloat16),
        torch.empty(0),
    ]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    with torch.no_grad():
        seam.foreach_copy(dsts, srcs)
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src.detach()) and dst.dtype == src.dtype
    assert not dsts[0].requires_grad and dsts[0].grad_fn is None
    seam.foreach_copy([], [])  # a state with no tensor: nothing to copy, no error


def test_preload_imports_what_the_template_preloads() -> None:
    """preload imports each module of PRELOADED (what the worker template does for the
    workers) and says whether it could."""
    done = _run_python(
        """
        import sys
        from steadfast import seam
        assert "torch._dynamo" not in sys.modules
        assert all([seam.preload(name) for name in seam.PRELOADED])
        assert all(name in sys.modules for name in seam.PRELOADED)
        assert seam.PRELOADED == ("torch._dynamo", "torch._inductor.compile_fx")
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_what_every_worker_preloads_is_what_an_optimizer_imports() -> None:
    """PRELOADED_BY_ALL (imported by the template before it serves, on CPU builds) is what
    the construction of any torch.optim optimizer imports; the rest of PRELOADED (imported
    once the first workers run) is not: a script that never compiles never needs it."""
    done = _run_python(
        """
        import sys
        import torch
        from steadfast import seam
        assert set(seam.PRELOADED_BY_ALL) < set(seam.PRELOADED)
        assert not any(name in sys.modules for name in seam.PRELOADED)
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        assert all(name in sys.modules for name in seam.PRELOADED_BY_ALL)
        rest = set(seam.PRELOADED) - set(seam.PRELOADED_BY_ALL)
        assert rest and not any(name in sys.modules for name in rest)
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_bad_fork_flag_is_read_on_every_build() -> None:
    """cuda_fork_poisoned reads torch.cuda._is_in_bad_fork, there on CPU builds too: a
    process that never started CUDA forks children that can."""
    done = _run_python(
        """
        import os
        from steadfast import seam
        import torch
        assert seam.cuda_built() == torch.backends.cuda.is_built()
        pid = os.fork()
        if pid == 0:
            os._exit(3 if seam.cuda_fork_poisoned() else 0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_agents_grace_is_passed_only_to_a_torch_that_takes_it() -> None:
    """``agent_grace`` names ``shutdown_timeout`` exactly when this torch's agent takes it
    (the torch steadfast is built on does; 2.11 does not, and got it as an unexpected
    keyword: ``steadfast launch`` failed at its start)."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    takes = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters
    assert seam.agent_grace(7) == ({"shutdown_timeout": 7} if takes else {})


def test_thread_frame_is_another_threads_current_frame() -> None:
    """steadfast.progress's stack thread reads the main thread's frame while it waits."""
    import threading

    from steadfast import seam

    seen: list[object] = []
    main = threading.get_ident()
    reader = threading.Thread(target=lambda: seen.append(seam.thread_frame(main)))
    reader.start()
    reader.join()
    frame = seen[0]
    assert frame is not None and frame.f_code.co_filename.endswith("threading.py")  # type: ignore[attr-defined]
    assert seam.thread_frame(-1) is None


def test_on_compile_brackets_each_outermost_compilation_once() -> None:
    import torch

    seam.preload("torch._dynamo")
    calls: list[str] = []
    remove = seam.on_compile(lambda: calls.append("start"), lambda: calls.append("end"))
    assert remove is not None
    try:
        fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
        fn(torch.ones(3))
        fn(torch.ones(3))  # cached: no compilation
    finally:
        remove()
    assert calls == ["start", "end"]
    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(3))
    assert calls == ["start", "end"]  # removed


def test_dataloader_iterator_type_defines_every_iterators_next() -> None:
    import torch
    import torch.utils.data as data

    base = seam.dataloader_iterator_type()
    dataset = data.TensorDataset(torch.arange(4.0))
    for workers in (0, 1):
        it = iter(data.DataLoader(dataset, batch_size=2, num_workers=workers))
        assert isinstance(it, base) and type(it).__next__ is base.__next__
        assert next(it)[0].tolist() == [0.0, 1.0]
        del it


def test_inductor_header_dir_is_inductors_own() -> None:
    done = _run_python(
        """
        from torch._inductor import codecache
        from steadfast import seam
        assert str(seam.inductor_header_dir()) == codecache._HEADER_DIR, codecache._HEADER_DIR
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_weights_only_loads_reads_a_plain_pickle_and_refuses_code() -> None:
    """weights_only_loads unpickles with torch._weights_only_unpickler: the flat
    snapshot header's types come back; a global it does not allow is refused, as
    torch.load(weights_only=True) refuses it."""
    import os
    import pickle

    import pytest
    import torch

    from steadfast import seam

    header = (
        {"a": [1, 2.5, "x", None, True, b"raw"], 3: ("\x00slot", 7)},
        [(torch.float32, (2, 3), 0), (torch.bfloat16, (), 64)],
        torch.Size([4, 5]),
        torch.device("cpu"),
    )
    assert seam.weights_only_loads(pickle.dumps(header, protocol=2)) == header
    with pytest.raises(pickle.UnpicklingError):
        seam.weights_only_loads(pickle.dumps(os.system, protocol=2))


def test_compiled_original_is_the_module_torch_compile_wrapped() -> None:
    import torch

    inner = torch.nn.Linear(2, 2)
    compiled = torch.compile(inner, backend="eager")
    assert seam.compiled_original(compiled) is inner
    assert seam.compiled_original(inner) is inner
