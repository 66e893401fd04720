"""steadfast.progress's parts in one process: the probe's count of iterations for every
optimizer shape a script brings, its top module and forward times (no device sync),
its stack thread; the judge's culprit; the report's steps of a script that reports
none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from steadfast.events import Event
from steadfast.progress import layout
from steadfast.progress.judge import CPU_SHARE, Judge, Look, culprit, summarize_stack
from steadfast.progress.probe import Probe
from steadfast.progress.proc import sample
from steadfast.report.steps import seen_steps


def progress(p: Probe) -> layout.Progress:
    return layout.read(p.slots)


def train(model: torch.nn.Module, step: Any, iterations: int) -> None:
    for _ in range(iterations):
        model(torch.randn(4, 8)).sum().backward()
        step()


def test_one_optimizer_counts_each_step(probe: Probe):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt.step, 5)
    g = progress(probe)
    assert g.steps == 5 and g.forwards == 5 and g.flags & layout.FLAG_TOP
    assert g.step_base == 0  # Adam's own step count: iteration 1 is its step 1 (index 0)
    ends = [end for _, end in layout.step_times(probe.slots, 0, 5)]
    assert ends == sorted(ends) and g.last_step == ends[-1] and g.mark >= ends[-1]


def test_a_container_optimizer_stepping_its_members_is_one_step(probe: Probe):
    """torchtitan's shape: an Optimizer over every parameter whose step steps each
    member optimizer: three step calls per iteration, nested."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

    class Container(torch.optim.Optimizer):
        def __init__(self) -> None:
            self.members = [torch.optim.SGD(m.parameters(), lr=0.1) for m in model]
            super().__init__(list(model.parameters()), {})

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for member in self.members:
                member.step()

    opt = Container()
    train(model, opt.step, 4)
    assert progress(probe).steps == 4


def test_a_subclass_calling_super_step_is_one_step(probe: Probe):
    model = torch.nn.Linear(8, 1)
    torch.optim.AdamW(model.parameters())  # AdamW's own step is hooked too now

    class Mine(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    opt = Mine(model.parameters())
    train(model, opt.step, 3)
    assert progress(probe).steps == 3


def test_several_optimizers_are_one_step(probe: Probe):
    """A GAN's two optimizers, each once per iteration."""
    gen, disc = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    g_opt, d_opt = torch.optim.SGD(gen.parameters(), 0.1), torch.optim.SGD(disc.parameters(), 0.1)
    for _ in range(3):
        disc(gen(torch.randn(4, 8)).detach()).sum().backward()
        d_opt.step()
        disc(gen(torch.randn(4, 8))).sum().backward()
        g_opt.step()
    assert progress(probe).steps == 3


def test_an_optimizer_per_parameter_stepped_in_the_backward_is_one_step(probe: Probe):
    model = torch.nn.Linear(8, 1)
    per_param = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: per_param[p].step())
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward()
    assert progress(probe).steps == 4


def test_a_step_gradscaler_skips_is_not_counted(probe: Probe):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(4):
        loss = model(torch.randn(4, 8)).sum() * (float("inf") if i == 2 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)  # an inf gradient: the step is skipped, no hook fires
        scaler.update()
        opt.zero_grad()
    assert progress(probe).steps == 3


def test_the_top_module_is_the_first_with_trainable_parameters(probe: Probe):
    """A loss module (no parameters) and a frozen preprocessing module are called
    first; the model is the top module, and its forwards alone are timed."""
    frozen = torch.nn.Linear(8, 8).requires_grad_(False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(torch.zeros(2), torch.ones(2))
    for _ in range(3):
        loss_fn(model(frozen(torch.randn(4, 8))), torch.zeros(4, 1)).backward()
        opt.step()
    assert progress(probe).forwards == 3 and progress(probe).steps == 3
    assert probe._search_handles == []  # the global hook is gone once the top is found
    with torch.no_grad():  # an evaluation forward: a mark, no iteration
        before = progress(probe).mark
        model(torch.randn(4, 8))
    assert progress(probe).mark > before and progress(probe).steps == 3


def test_forward_times_on_cuda_come_from_completed_events_only(probe: Probe, monkeypatch):
    """The CUDA path without a device: fake events that complete one forward later.
    elapsed_time is read only of an event whose query() said it completed, and nothing
    waits for the device (no synchronize, no blocking call)."""
    calls: list[str] = []

    class FakeEvent:
        def __init__(self) -> None:
            self.recorded = 0
            self.done = False

        def record(self) -> None:
            self.recorded += 1
            self.done = False
            calls.append("record")

        def query(self) -> bool:
            calls.append("query")
            done, self.done = self.done, True  # complete by the next look
            return done

        def elapsed_time(self, end: FakeEvent) -> float:
            assert end.done, "elapsed_time of an event not known complete: a sync"
            calls.append("elapsed")
            return 20.0

        def synchronize(self) -> None:  # pragma: no cover - must never be called
            raise AssertionError("synchronize: a host-device sync")

    monkeypatch.setattr(probe, "_cuda_pair", lambda: (FakeEvent(), FakeEvent()))
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8))  # finds the top module (CPU: perf_counter)
    probe._flags |= layout.FLAG_CUDA  # as if its parameters were on a GPU
    before = progress(probe).forwards
    train(model, opt.step, 4)
    assert "elapsed" in calls and progress(probe).forwards > before
    assert layout.forward_times(probe.slots, before, before + 1) == [0.02]


def test_the_stack_thread_answers_while_the_main_thread_waits(probe: Probe):
    judge = Judge({0: (probe.slots, probe.area, probe.ask)})
    verdict = judge.look({0: os.getpid()}, window=0.4)  # this thread waits in it
    [look] = verdict.looks
    assert look.answered is True and look.state in ("R", "S")
    assert "test_the_stack_thread_answers_while_the_main_thread_waits" in look.stack


def _spin(cpu: int) -> int:
    """A child that computes forever on CPU ``cpu`` (its pid), at the lowest priority:
    the suite's other tests on that CPU hardly notice it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.nice(19)
            os.sched_setaffinity(0, {cpu})
            while True:
                pass
        finally:
            os._exit(0)
    return pid


def test_a_rank_that_computes_on_a_machine_busy_with_other_work_moves(probe: Probe):
    """A rank computing on a CPU that six other processes of its priority want too gets
    at most a seventh of it, less than the share a mover must compute (CPU_SHARE): it
    waited on the run queue the rest of the window, which a rank blocked or asleep
    never does."""
    cpu = min(os.sched_getaffinity(0))
    pids = [_spin(cpu) for _ in range(7)]
    try:
        time.sleep(0.2)  # every child pinned and spinning
        judge = Judge({0: (probe.slots, probe.area, probe.ask)})
        [look] = judge.look({0: pids[0]}, window=1.0).looks
        assert look.moved == ["cpu"], look
        os.kill(pids[0], signal.SIGSTOP)  # stopped: runnable no more
        [look] = judge.look({0: pids[0]}, window=0.5).looks
        assert look.state == "T" and look.moved == []
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_starved_rank_waits_on_the_run_queue_an_asleep_one_does_not():
    """What the judge's "moves" is made of: /proc's CPU time, and the time runnable but
    waiting for a CPU (``schedstat``)."""
    cpu = min(os.sched_getaffinity(0))
    pids = [_spin(cpu) for _ in range(7)]
    asleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        before, idle = sample(pids[0]), sample(asleep.pid)
        time.sleep(1.0)
        after, still = sample(pids[0]), sample(asleep.pid)
        got, waited = after.cpu - before.cpu, after.waited - before.waited
        assert got < CPU_SHARE, got  # a seventh of a CPU: too little to count alone
        assert got + waited >= CPU_SHARE * 3, (got, waited)  # runnable all along
        assert still.waited - idle.waited < 0.01 and still.cpu - idle.cpu < 0.01
    finally:
        asleep.kill()
        asleep.wait()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _look(local: int, state: str = "S", where: str = "x", waiting: bool = False, **kw: Any):
    return Look(local, 100 + local, state, kw.get("moved", []), kw.get("answered", True),
                "", where, waiting)  # fmt: skip


def test_the_culprit_is_the_rank_not_where_the_others_are():
    waiting = [_look(i, where="all_reduce", waiting=True) for i in range(4)]
    assert culprit([*waiting, _look(4, state="T", answered=None)]).local == 4  # stopped
    assert culprit([*waiting, _look(4, answered=False)]).local == 4  # holds the GIL
    assert culprit([*waiting, _look(4, where="__next__")]).local == 4  # outside them
    # a stopped rank before one that did not answer (a busy machine may delay an answer)
    assert culprit([*waiting, _look(4, answered=False), _look(5, state="T")]).local == 5
    assert culprit(waiting) is None  # every rank in the same collective: no guess
    odd = [*waiting[:3], _look(3, where="barrier", waiting=True)]
    assert culprit(odd).local == 3  # alone in another collective
    assert culprit([_look(0, where="sleep"), _look(1, where="sleep")]) is None


def test_where_a_stack_waits():
    c10d = "/x/site-packages/torch/distributed/distributed_c10d.py:2800 all_reduce"
    assert summarize_stack(f"/u/train.py:3 main\n{c10d}") == ("all_reduce", True)
    backward = "/u/train.py:3 main\n/x/site-packages/torch/autograd/graph.py:8 _engine_run"
    assert summarize_stack(backward, ddp=True) == ("backward (DDP's all-reduce)", True)
    assert summarize_stack(backward) == ("_engine_run", False)
    assert summarize_stack("/u/train.py:3 main\n/u/train.py:9 step") == ("step (train.py:9)", False)


def _seen(ends: list[float], first: int, base: int | None, pid: int) -> Event:
    fields = {"host": "n1", "worker_pid": pid, "first": first, "ends": ends, "base": base}
    return Event(time=ends[-1], kind="steps_seen", rank=0, step=None, cause=None, fields=fields)


def test_steps_seen_become_steps_and_redone_ones_are_counted_where_known():
    # a first process ran iterations 1-4 (its optimizer's steps 0-3); a restart resumed
    # from step 2 (its snapshot) and ran 2-5: steps 2 and 3 were done twice
    evs = [_seen([1.0, 2.0, 3.0, 4.0], 1, 0, 10), _seen([11.0, 12.0, 13.0, 14.0], 1, 2, 20)]
    steps, known = seen_steps(evs)
    assert known and [e.step for e in steps] == [0, 1, 2, 3, 2, 3, 4, 5]
    assert [e.get("seconds") for e in steps] == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    steps, known = seen_steps([_seen([1.0, 2.0], 1, None, 10), _seen([5.0], 3, None, 10)])
    assert not known and len({e.step for e in steps}) == 3
    assert [e.get("seconds") for e in steps] == [0.0, 1.0, 3.0]


def test_a_forked_child_writes_nothing_into_the_rank_row(probe: Probe, tmp_path: Path):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt.step, 2)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker's shape: the hooks are there, the row is not its
        try:
            train(model, opt.step, 3)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.01)
    assert progress(probe).steps == 2
