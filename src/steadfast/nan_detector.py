"""NaN/Inf detection that every rank agrees on: :class:`NaNDetector` and its
:class:`NaNState`.

Parity with ``kempnerforge.resilience`` (seed 000): same names, defaults and return
values. Beyond the original:

- ``check_loss`` *and* ``check_gradients`` agree across ranks (one tiny all-reduce on the
  backend's device), so no rank skips an optimizer step that another rank takes. That
  all-reduce also carries the agreed shutdown's flag (:mod:`steadfast.riders`), so a loop
  with both makes one collective a step for the two.
- ``check_gradients`` checks every gradient with one fused reduction per device/dtype
  (an infinity-norm, which never overflows and propagates NaN:
  :func:`steadfast.seam.foreach_inf_norms`) and one host sync in all, instead of a sync
  per parameter; names of offending parameters are looked up only on the rare bad step.
- With ``action="skip"``, ``check_gradients`` drops the gradients (``grad = None``) so an
  ``optimizer.step()`` that follows is a true no-op (zeros would still move momentum).
- NaN counts survive a restart through ``state_dict`` / ``load_state_dict``.
- Each NaN step is an event (``nan_detected``) and the first step at which a rollback is
  recommended is one too (``nan_rollback_recommended``).

A NaN is a fault of the training, not of the node: node and collective health checks
are :mod:`steadfast.health`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import events, riders, seam
from .config import ConfigError, require_number
from .dist import backend_device, group_rank, is_distributed

__all__ = ["NaNDetector", "NaNState"]

logger = logging.getLogger(__name__)

_ACTIONS = ("warn", "skip", "raise")


@dataclass
class NaNState:
    """Tracks NaN/Inf occurrences across training steps."""

    consecutive_nans: int = 0
    total_nans: int = 0
    last_good_loss: float = float("inf")
    last_good_step: int = 0
    nan_steps: list[int] = field(default_factory=list)


class NaNDetector:
    """Detects and tracks NaN/Inf values in loss and gradients.

    Supports three responses to NaN:

    - ``"warn"``: log a warning and continue (the check still returns False).
    - ``"skip"``: skip the optimizer step. ``check_loss`` returns False so the loop skips;
      ``check_gradients`` also drops the gradients so a following ``optimizer.step()`` is a
      no-op.
    - ``"raise"``: raise a ``RuntimeError`` (on every rank at the same step).

    If the consecutive NaN count reaches ``max_consecutive``, :attr:`should_rollback`
    becomes True: the detector recommends rolling back to the last checkpoint.

    Args:
        action: What to do when NaN is detected.
        max_consecutive: Consecutive NaN steps before recommending rollback (>= 1).
        max_history: Number of NaN step indices to retain (the most recent are kept).
    """

    def __init__(self, action: str = "warn", max_consecutive: int = 5, max_history: int = 100):
        if action not in _ACTIONS:  # KempnerForge's message, with the field named first
            raise ConfigError(
                f"NaNDetector.action: Invalid NaN action: {action!r}. Must be one of "
                f"{', '.join(map(repr, _ACTIONS))}"
            )
        self.action = action
        self.max_consecutive = require_number(
            "NaNDetector.max_consecutive", max_consecutive, minimum=1, integer=True
        )
        self.max_history = require_number(
            "NaNDetector.max_history", max_history, minimum=0, integer=True
        )
        self.state = NaNState()
        self._last_nan_step: int | None = None
        # (last_good_loss, last_good_step, consecutive_nans) before the latest good step,
        # so that gradients found bad after a good loss can undo that step's "good"
        self._previous_good: tuple[float, int, int] | None = None

    # ------------------------------------------------------------------ checks
    def check_loss(self, loss: float | torch.Tensor, step: int, group: Any = None) -> bool:
        """Check a loss value for NaN/Inf, agreeing across ranks.

        When running distributed, all-reduces a NaN flag so ALL ranks agree on whether to
        skip: a rank that sees a NaN and skips its optimizer step while others proceed
        would desynchronise the replicas. ``loss`` may be a float or a scalar tensor on any
        device; a tensor costs one host sync in all (which returning a bool needs anyway).

        Returns:
            True if the loss is valid (finite) on ALL ranks, False if any rank has NaN/Inf.

        Raises:
            RuntimeError: If action is "raise" and NaN is detected (on every rank).
        """
        if isinstance(loss, torch.Tensor) and loss.numel() != 1:
            raise ConfigError(
                f"NaNDetector.check_loss: loss must be a scalar (one element), "
                f"got a tensor of shape {tuple(loss.shape)}"
            )
        device = backend_device(group)
        distributed = is_distributed()
        carried = riders.carry(group)
        if device.type == "cpu":  # the value first: two torch calls fewer on the step
            value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
            flags = torch.tensor(
                [0.0 if math.isfinite(value) else 1.0, carried.up], dtype=torch.float64
            )
            if distributed:
                dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
            ranks_bad, riding = flags.tolist()
        else:  # reduced where the loss is: the one host sync comes after the collective
            if isinstance(loss, torch.Tensor):
                value_t = loss.detach().reshape(1).to(device=device, dtype=torch.float64)
            else:
                value_t = torch.tensor([float(loss)], dtype=torch.float64, device=device)
            flags = torch.full((2,), carried.up, dtype=torch.float64, device=device)
            flags[:1] = ~torch.isfinite(value_t)
            if distributed:
                dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
            ranks_bad, riding, value = torch.cat([flags, value_t]).tolist()
        carried.deliver(riding)
        local_bad = not math.isfinite(value)
        if ranks_bad == 0:
            self._record_good(value, step)
            return True
        self._record_nan(step, "loss", local_bad, int(ranks_bad), value, group=group)
        return False

    def check_gradients(self, model: torch.nn.Module, step: int, group: Any = None) -> bool:
        """Check model gradients for NaN/Inf before the optimizer step, agreeing across ranks.

        All gradients are reduced with one fused infinity-norm per device and dtype, then
        one all-reduce of a flag; the result is read with a single host sync.

        Returns:
            True if all gradients are finite on ALL ranks.

        Raises:
            RuntimeError: If action is "raise" and a NaN/Inf gradient is found.
        """
        grads = [_dense(p.grad) for p in model.parameters() if p.grad is not None]
        device = backend_device(group)
        local_bad_t = torch.zeros(1, dtype=torch.float64, device=device)
        for norms in _inf_norms(grads):
            all_finite = torch.isfinite(torch.stack(norms)).all()
            local_bad_t += (~all_finite).to(device=device, dtype=torch.float64)
        local_bad_t.clamp_(max=1.0)
        carried = riders.carry(group)
        total_t = torch.cat([local_bad_t, local_bad_t.new_full((1,), carried.up)])
        if is_distributed():
            dist.all_reduce(total_t, op=dist.ReduceOp.SUM, group=group)
        ranks_bad, riding, local_bad = torch.cat([total_t, local_bad_t]).tolist()  # one sync
        carried.deliver(riding)
        if ranks_bad == 0:
            return True
        bad_names = _nonfinite_params(model) if local_bad else []
        if self.action == "skip":
            model.zero_grad(set_to_none=True)
        self._record_nan(
            step, "gradients", bool(local_bad), int(ranks_bad), None, bad_names, group=group
        )
        return False

    # ------------------------------------------------------------------ state
    @property
    def should_rollback(self) -> bool:
        """Whether the consecutive NaN count suggests a checkpoint rollback."""
        return bool(self.state.consecutive_nans >= self.max_consecutive)

    def reset(self) -> None:
        """Reset NaN tracking state (e.g., after a rollback)."""
        self.state = NaNState()
        self._last_nan_step = None
        self._previous_good = None

    def state_dict(self) -> dict[str, Any]:
        """The counts, for a checkpoint, so that they survive a restart."""
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts saved by :meth:`state_dict`; a malformed dict raises ConfigError."""
        if not isinstance(state, dict):
            raise ConfigError(f"NaNDetector state: expected a dict, got {type(state).__name__}")
        expected = set(asdict(NaNState()))
        missing, unknown = expected - set(state), set(state) - expected
        if missing or unknown:
            raise ConfigError(
                f"NaNDetector state: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}"
            )
        for key in ("consecutive_nans", "total_nans", "last_good_step"):
            require_number(f"NaNDetector state.{key}", state[key], minimum=0, integer=True)
        last_good = state["last_good_loss"]
        if last_good != float("inf"):  # inf: no good loss seen yet (the initial state)
            require_number("NaNDetector state.last_good_loss", last_good)
        steps = state["nan_steps"]
        if not isinstance(steps, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in steps
        ):
            raise ConfigError("NaNDetector state.nan_steps: expected a list of integers")
        self.state = NaNState(
            consecutive_nans=state["consecutive_nans"],
            total_nans=state["total_nans"],
            last_good_loss=float(state["last_good_loss"]),
            last_good_step=state["last_good_step"],
            nan_steps=list(steps),
        )
        self._last_nan_step = None
        self._previous_good = None

    # ------------------------------------------------------------------ internals
    def _record_good(self, value: float, step: int) -> None:
        st = self.state
        self._previous_good = (st.last_good_loss, st.last_good_step, st.consecutive_nans)
        self.state.consecutive_nans = 0
        self.state.last_good_loss = value
        self.state.last_good_step = step

    def _record_nan(
        self,
        step: int,
        source: str,
        local: bool,
        ranks_affected: int,
        value: float | None,
        params: list[str] | None = None,
        group: Any = None,
    ) -> None:
        st = self.state
        if self._last_nan_step != step:  # loss and gradients of one step count once
            if st.last_good_step == step and self._previous_good is not None:
                # check_loss passed at this step but the gradients did not: undo "good"
                st.last_good_loss, st.last_good_step, st.consecutive_nans = self._previous_good
            st.consecutive_nans += 1
            st.total_nans += 1
            st.nan_steps.append(step)
            if len(st.nan_steps) > self.max_history:
                del st.nan_steps[: len(st.nan_steps) - self.max_history]
            self._last_nan_step = step
        where = f" in {', '.join(params[:5])}" if params else ""
        msg = (
            f"NaN/Inf {source}{where} at step {step} on {ranks_affected} rank(s)"
            f"{' including this one' if local else ''} "
            f"(consecutive={st.consecutive_nans}, total={st.total_nans}, "
            f"last_good_loss={st.last_good_loss:.4f} at step {st.last_good_step})"
        )
        if local:
            extra: dict[str, Any] = {"params": params[:5]} if params else {}
            if value is not None:
                extra["value"] = value
            events.emit(
                "nan_detected",
                step=step,
                cause=source,
                source=source,
                local=True,
                ranks_affected=ranks_affected,
                consecutive=st.consecutive_nans,
                total=st.total_nans,
                action=self.action,
                **extra,
            )
        if st.consecutive_nans == self.max_consecutive and group_rank(group) == 0:
            events.emit(
                "nan_rollback_recommended",
                step=step,
                cause=source,
                consecutive=st.consecutive_nans,
                max_consecutive=self.max_consecutive,
                last_good_step=st.last_good_step,
            )
        if self.action == "raise":
            raise RuntimeError(msg)
        if self.action == "skip":
            logger.warning("%s - skipping optimizer step", msg)
        else:
            logger.warning(msg)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.coalesce().values() if t.is_sparse else t


def _inf_norms(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Infinity norms of ``tensors``, one fused kernel per (device, dtype) group."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    return [seam.foreach_inf_norms(ts) for ts in groups.values()]


def _nonfinite_params(model: torch.nn.Module) -> list[str]:
    """Names of parameters whose gradient is non-finite (slow path, bad steps only)."""
    return [
        name
        for name, p in model.named_parameters()
        if p.grad is not None and not bool(torch.isfinite(_dense(p.grad)).all())
    ]
