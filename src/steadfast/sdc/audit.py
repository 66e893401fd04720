"""Compute corruption found before the reduction: sampled micro-batches re-run on other
hardware (the library path).

A wrong product in one rank's backward (a "mercurial" core, a bad activation) is averaged
into every replica: they then agree on a wrong value, and the replica check
(:mod:`.board`) cannot see it. :class:`ComputeAudit` recomputes it instead: every
``every`` steps each rank has its local, pre-reduction gradients fingerprinted by a DDP
communication hook (which then makes DDP's own all-reduce) and hands its micro-batch and
RNG state to the next rank (a ring), which recomputes the gradients on the same
parameters and compares: every rank is audited every ``every`` steps, whatever the
world's size, at the cost of one more forward and backward of one micro-batch per rank
per audit (a share of ``1 / every`` of a one-micro-batch step, reported in
``compute_audited``). A mismatch is re-run in place on the auditee: not reproduced
there, the fault was transient; reproduced, a third rank (where there is one) tells
which of the two computes wrongly. No replica ever takes the wrong gradient in: a
transient fault's step is re-done at once by every rank (same batch, same RNG, buffers
as they were: the state goes on bit for bit as if nothing had happened); a persistent
one's update is skipped and the loop is asked to save and exit 16 (the seed's
``EXIT_CODE_RESUME_TO_DISAMBIGUATE``: the launcher requeues the job away from the
hardware ``rerun_elsewhere`` names).

Fingerprints are the CRC-32 of each parameter's gradient (``-0.0`` made ``+0.0``: an
accumulation into zeros may turn one into the other) where the kernels are deterministic
(on the CPU, or with ``torch.use_deterministic_algorithms``), else each gradient's norm,
compared within the seed's relative ``tolerance``.

Loop contract::

    audit = ComputeAudit(ddp_model, loss_fn=lambda module, batch: ..., every=200)
    for step, batch in enumerate(loader):
        with audit.step(step, batch):
            loss = loss_fn(ddp_model, batch)
            loss.backward()
        if audit.passed:
            optimizer.step()
        save, leave, code = audit.should_checkpoint_and_exit()

Not audited: gradients accumulated over several backwards (``no_sync``), models that
are not DDP's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import events
from ..dist import agree_any, all_gather_object
from .fingerprint import crc32

__all__ = ["ComputeAudit"]

logger = logging.getLogger(__name__)


class ComputeAudit:
    """The audits of one DDP model's steps (see the module docstring). ``loss_fn(module,
    batch)``: the step's loss on ``module`` (DDP's model, or the model inside it for a
    recomputation); ``every``: steps between two audits (200: one more forward and
    backward of one micro-batch every 200 steps, 0.5 % of a step of one micro-batch, and
    every rank audited every 200 steps); ``tolerance``: the relative difference allowed between two
    gradients' norms where the kernels are not deterministic."""

    def __init__(
        self,
        ddp: Any,
        loss_fn: Callable[[Any, Any], Any],
        every: int = 200,
        tolerance: float = 1e-5,
        group: Any = None,
    ) -> None:
        import torch
        import torch.distributed as dist

        if every < 1:
            raise ValueError(f"ComputeAudit.every: {every} is not a positive number of steps")
        self.ddp, self.loss_fn, self.every, self.tolerance = ddp, loss_fn, every, tolerance
        self.module = ddp.module
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # point-to-point and the agreement on a CPU group of its own, made on every rank
        self.group = dist.new_group(backend="gloo") if group is None else group
        self.bitwise = self.params[0].device.type == "cpu" or bool(
            torch.are_deterministic_algorithms_enabled()
        )
        self.passed = True
        self.exit_code = 0  # 16 once a persistent fault was found
        self.audits = 0
        self.seconds = 0.0  # spent in audits, this rank
        self._auditing = False
        self._mine: dict[int, Any] = {}  # param index -> fingerprint, the hook's
        self._rng: Any = None  # the auditee's RNG state at the step's start
        self._own: Any = None  # every rank's RNG state and buffers at an audit step's start
        self._clean: int | None = None  # the last audit step every rank passed
        # a lambda: DDP refuses a hook whose annotations are not its own types
        ddp.register_comm_hook(self, lambda state, bucket: _hook(state, bucket))

    # ------------------------------------------------------------------ the loop's side
    @contextlib.contextmanager
    def step(self, step: int, batch: Any) -> Iterator[None]:
        """Around the step's forward and backward: on an audit step, the auditee's RNG is
        kept before the forward, its gradients fingerprinted before the reduction, and
        the audit made after the backward (:attr:`passed` says whether to step)."""
        import torch

        self.passed = True
        self._auditing = step % self.every == 0 and self.world > 1
        self._rng, self._mine = None, {}
        if self._auditing:  # what a re-done step starts from; the hook fingerprints
            self._own = (_rng_state(torch, self.params[0].device),
                         [b.detach().clone() for b in self.module.buffers()])  # fmt: skip
            self._rng = self._own[0]
        yield
        if self._auditing:
            began = time.perf_counter()
            try:
                self.passed = self._audit(step, batch)
            finally:
                self._auditing = False
                self.audits += 1
                self.seconds += time.perf_counter() - began

    # ------------------------------------------------------------------ the audit
    def _audit(self, step: int, batch: Any) -> bool:
        """Each rank recomputes the previous rank's step (a ring); a mismatch is judged."""
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        first = dict(self._mine)
        theirs = _exchange([batch, self._rng, first], nxt, prev, self.group)
        again = self._recompute(theirs[0], theirs[1])
        flags = _gather_flags(not self._same(again, theirs[2]), self.group, self.world)
        bad = [(r - 1) % self.world for r, flag in enumerate(flags) if flag]
        if not bad:
            self._clean = step
            if self.rank == 0:
                events.emit("compute_audited", step=step, ranks=self.world, every=self.every,
                            seconds=round(self.seconds, 6))  # fmt: skip
            return True
        auditee = bad[0]  # one judged at a time: the others' steps are not applied either
        how = self._judge(step, batch, auditee, (auditee + 1) % self.world, first)
        if how == "transient" and len(bad) == 1:
            self._redo(batch)
            return True
        self.exit_code = 16  # the same hardware would give the same answer
        return False  # the step's wrong gradient is never applied

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """``(should_checkpoint, should_exit, exit_code)`` (the re-run machine's
        contract): after a persistent fault, save and exit 16."""
        leave = self.exit_code != 0
        return leave, leave, self.exit_code

    def _redo(self, batch: Any) -> None:
        """Every rank re-does the step through DDP (its all-reduce included) from the
        RNG state and buffers it began with: the gradients a fault-free step makes."""
        import torch

        rng, buffers = self._own
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers, strict=True):
                b.copy_(saved)
        _set_rng_state(torch, self.params[0].device, rng)
        for p in self.params:
            p.grad = None
        self.loss_fn(self.ddp, batch).backward()

    def _judge(
        self, step: int, batch: Any, auditee: int, auditor: int, first: dict[int, Any] | None
    ) -> str:
        """A mismatch: the auditee re-runs in place; a third rank, where there is one,
        recomputes the auditee's batch when the in-place run reproduced its result."""
        third = (auditee + 2) % self.world if self.world >= 3 else None
        reproduced = False
        if self.rank == auditee:
            assert first is not None
            reproduced = self._same(self._recompute(batch, self._rng), first)
        reproduced = agree_any(reproduced, self.group)
        culprits, how = [auditee], "transient"
        if reproduced and third is not None:
            if self.rank == auditee:
                _send_packed([batch, self._rng, first], third, self.group)
            verdict = False
            if self.rank == third:
                box = _recv_packed(auditee, self.group)
                verdict = self._same(self._recompute(box[0], box[1]), box[2])
            # the third agrees with the auditee: the auditor computes wrongly
            culprits, how = ([auditor], "odd_one_out") if agree_any(verdict, self.group) else (
                [auditee], "odd_one_out")  # fmt: skip
        elif reproduced:
            culprits, how = sorted({auditee, auditor}), "pair"
        hosts = [str(h) for h in all_gather_object(socket.gethostname(), self.group)]
        if self.rank == 0:
            events.emit(
                "sdc_detected",
                cause="audit_mismatch",
                step=step,
                replicas=[auditee, auditor],
                check=self.audits,
            )
            events.emit(
                "sdc_verdict",
                cause=how,
                culprits=culprits,
                hosts=[hosts[r] for r in culprits],
                local_ranks=[],
                replicas=self.world,
                last_agreed_step=self._clean,
                first_bad_step=step,
                step=step,
            )
        if how != "transient" and self.rank in culprits:
            from ..rerun.results import hardware_id  # the re-run machine's: its requeue

            events.emit("rerun_elsewhere", step=step, cause="audit", hardware=hardware_id())
        logger.error(
            "compute audit of step %d: rank %d's gradients differ from rank %d's recomputation"
            " (%s: rank(s) %s); %s",
            step, auditee, auditor, how, culprits,
            "the step is re-done" if how == "transient" else "the update is skipped; exit 16",
        )  # fmt: skip
        return how

    def _recompute(self, batch: Any, rng: Any) -> dict[int, Any]:
        """The gradients of ``loss_fn(module, batch)`` on this rank's parameters (the
        same as every replica's before the step), with ``rng`` as the RNG state; the
        module's buffers and this rank's RNG left as they were."""
        import torch

        device = self.params[0].device
        own_rng = _rng_state(torch, device)
        buffers = [b.detach().clone() for b in self.module.buffers()]
        try:
            _set_rng_state(torch, device, rng)
            loss = self.loss_fn(self.module, batch)
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        finally:
            with torch.no_grad():
                for b, saved in zip(self.module.buffers(), buffers, strict=True):
                    b.copy_(saved)
            _set_rng_state(torch, device, own_rng)
        return {i: self._fingerprint(g) for i, g in enumerate(grads) if g is not None}

    def _fingerprint(self, grad: Any) -> Any:
        if not self.bitwise:
            return float(grad.float().norm())
        flat = (grad.detach() + 0.0).contiguous().cpu()  # -0.0 -> +0.0
        size = flat.numel() * flat.element_size()
        view = (ctypes.c_char * size).from_address(int(flat.data_ptr()))
        return crc32(memoryview(view))

    def _same(self, a: dict[int, Any], b: dict[int, Any]) -> bool:
        if set(a) != set(b):
            return False
        if self.bitwise:
            return a == b
        return all(_close(a[i], b[i], self.tolerance) for i in a)

    def _record(self, bucket: Any) -> None:
        """The hook's part on the auditee: each gradient's fingerprint before DDP's
        all-reduce (which divides and sums it in place after)."""
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            index = self._index.get(id(p))
            if index is not None:
                self._mine[index] = self._fingerprint(g)


def _hook(audit: ComputeAudit, bucket: Any) -> Any:
    """DDP's communication hook: the auditee's fingerprints, then DDP's own all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if audit._auditing and audit._rng is not None:  # the auditee, on an audit step
        audit._record(bucket)
    return allreduce_hook(audit.ddp.process_group, bucket)


def _close(a: float, b: float, tolerance: float) -> bool:
    if a == b:
        return True
    if not (math.isfinite(a) and math.isfinite(b)) or a + b == 0:
        return False
    return abs((a - b) / (a + b) * 2) <= tolerance


def _pack(obj: Any) -> Any:
    """``obj`` (tensors, numbers, lists, dicts) as a byte tensor (``torch.save``'s bytes,
    read back with the weights-only unpickler: nothing but data is unpickled)."""
    import io

    import torch

    out = io.BytesIO()
    torch.save(obj, out)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def _unpack(buf: Any) -> Any:
    import io

    import torch

    data = ctypes.string_at(int(buf.data_ptr()), buf.numel())
    return torch.load(io.BytesIO(data), weights_only=True)


def _send_packed(obj: Any, dst: int, group: Any) -> None:
    import torch
    import torch.distributed as dist

    data = _pack(obj)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=group)
    dist.send(data, dst, group=group)


def _recv_packed(src: int, group: Any) -> Any:
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    buf = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(buf, src, group=group)
    return _unpack(buf)


def _exchange(obj: Any, dst: int, src: int, group: Any) -> Any:
    """Send ``obj`` to rank ``dst`` while receiving ``src``'s (every rank of the ring at
    once: non-blocking both ways)."""
    import torch
    import torch.distributed as dist

    mine = _pack(obj)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    theirs = torch.zeros(1, dtype=torch.int64)
    works = [dist.isend(size, dst, group=group), dist.irecv(theirs, src, group=group)]
    for w in works:
        if w is not None:
            w.wait()
    buf = torch.empty(int(theirs), dtype=torch.uint8)
    works = [dist.isend(mine, dst, group=group), dist.irecv(buf, src, group=group)]
    for w in works:
        if w is not None:
            w.wait()
    return _unpack(buf)


def _gather_flags(flag: bool, group: Any, world: int) -> list[bool]:
    """Every rank's ``flag``, on every rank."""
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(out, torch.tensor([int(flag)], dtype=torch.int32), group=group)
    return [bool(t.item()) for t in out]


def _rng_state(torch: Any, device: Any) -> Any:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(torch: Any, device: Any, state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
