"""The re-run state machine (Megatron-LM / Megatron Bridge, seed 003) for attributing
unexpected results (a NaN loss, a spiky loss) to transient faults, persistent faults of
one GPU, or correct-but-surprising results.

Training-loop contract (the seed's)::

    while machine.should_run_forward_backward(data_iterator):
        loss = forward_backward(next(data_iterator))
        machine.validate_result(loss, torch.isnan, "loss is NaN")
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()

Attribution, ``validate_results`` mode:

1. the initial run of a step validates its results; if any rank rejects one, every rank
   (one small all-reduce) re-runs the step *in place*: RNG states restored, the same
   micro-batches replayed by :class:`RerunDataIterator`;
2. not reproduced in place: a transient error (exit 17 if the check was ``fatal``, else
   training goes on);
3. reproduced in place: checkpoint and exit 16 (``EXIT_CODE_RESUME_TO_DISAMBIGUATE``) so
   the job restarts on other hardware, with the machine's state in the checkpoint;
4. after the restart on different hardware (node name + device, or
   ``$STEADFAST_RERUN_HARDWARE_ID``, which tests use to fake a move), the step is re-run
   once more: not reproduced there, the first GPU has a persistent error (training goes
   on, on the new hardware); reproduced, the result was correct (exit 17 if ``fatal``:
   the application produced it).

``report_stats`` re-runs every step once and reports non-determinism statistics.
Results compare as ``|(a - b) / (a + b) * 2|`` (0 when equal or both NaN, inf when only
one is finite).

This module holds the machine and the process's one (Megatron-LM's singleton); its
states and their drawn transitions are in :mod:`.states`, what it compares and records
in :mod:`.results`, its modes, exit codes and config in :mod:`.config`, the batches'
replay in :mod:`.data` (re-exported here). Replicas that silently disagree (a flipped
bit in one rank's state, with no result to doubt) are steadfast.sdc's.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from enum import Enum
from functools import partial
from typing import Any

from .. import events
from ..checkpoint.proof import on_bad_restore, resume_exactly
from ..checkpoint.state import RNGState
from ..config import ConfigError, require_choice
from ..dist import agree_any, agree_flags, world_info
from .config import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    HARDWARE_ID_ENV,
    MODES,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunStateMachineConfig,
    _mode,
)
from .data import RerunDataIterator
from .results import as_scalar, hardware_id, is_inf, is_nan, relative_difference, track
from .states import RerunState, check

__all__ = [
    "RerunDiagnostic",
    "RerunErrorInjector",
    "RerunMode",
    "destroy_rerun_state_machine",
    "get_rerun_state_machine",
    "initialize_rerun_state_machine",
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "HARDWARE_ID_ENV",
    "RerunDataIterator",
    "RerunState",
    "RerunStateMachine",
    "RerunStateMachineConfig",
    "relative_difference",
]

logger = logging.getLogger(__name__)


class RerunStateMachine:
    """See the module docstring. ``fatal`` results, exit codes and events follow the
    seed; every decision is agreed by all ranks with one small all-reduce."""

    def __init__(
        self,
        config: RerunStateMachineConfig | Callable[[], Any] | None = None,
        group: Any = None,
        seed: int | None = None,
        *,
        state_save_func: Callable[[], Any] | None = None,
        state_restore_func: Callable[[Any], None] | None = None,
        mode: RerunMode | str | None = None,
        error_injector: RerunErrorInjector | None = None,
        result_rejected_tracker_filename: str | None = None,
    ) -> None:
        if callable(config):  # Megatron-LM's positional form: (save, restore, mode, ...)
            state_save_func, config = config, None
            if callable(group):
                state_restore_func, group = group, None
            if isinstance(seed, (str, Enum)):
                mode, seed = seed, None
        cfg = config if isinstance(config, RerunStateMachineConfig) else RerunStateMachineConfig()
        if mode is not None or error_injector is not None or result_rejected_tracker_filename:
            injector = error_injector or RerunErrorInjector()
            cfg = RerunStateMachineConfig(
                rerun_mode=_mode(mode) if mode is not None else cfg.rerun_mode,
                check_for_nan_in_loss=cfg.check_for_nan_in_loss,
                check_for_spiky_loss=cfg.check_for_spiky_loss,
                spiky_loss_factor=cfg.spiky_loss_factor,
                error_injection_rate=injector.error_injection_rate
                if error_injector is not None
                else cfg.error_injection_rate,
                error_injection_type=injector.error_injection_type
                if error_injector is not None
                else cfg.error_injection_type,
                result_rejected_tracker_filename=result_rejected_tracker_filename
                or cfg.result_rejected_tracker_filename,
            )
        self.config = cfg
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self._user_saved: Any = None
        self.group = group
        self.state = RerunState.NOT_RUNNING_YET
        self.iteration = 0
        self._rng_saved: dict[str, Any] | None = None
        self._iterators: list[RerunDataIterator] = []
        self._pending_batches: list[dict[str, Any]] = []  # kept batches from a checkpoint
        self._invocation = 0
        self._initial: list[tuple[float, bool, str, bool]] = []  # result, rejected, msg, fatal
        self._rejected_here = False
        self._reproduced = True
        self._fatal = False
        self._failed_on: str | None = None
        self._pending_exit: tuple[bool, bool, int] = (False, False, 0)
        self._inject = random.Random(seed)
        self._injecting = False
        self._diffs: list[float] = []
        self._large: dict[str, list[float]] = {}
        self.verdicts: list[str] = []
        #: set when the restore this process resumed from failed its replay proof
        self.bad_restore: str | None = None

    # ------------------------------------------------------------------ loop contract
    def should_run_forward_backward(self, data_iterator: Any) -> bool:
        """Whether to run (or re-run) the step's forward-backward; call in a while loop.
        Each call moves the machine along one drawn transition (:mod:`.states`)."""
        step = {
            RerunState.NOT_RUNNING_YET: self._begin_step,
            RerunState.INITIAL_RUN: self._after_initial_run,
            RerunState.RERUNNING_IN_PLACE: self._after_rerun_in_place,
            RerunState.WILL_RERUN_FROM_CHECKPOINT: self._after_restart,
            RerunState.RERUNNING_FROM_CHECKPOINT: self._after_rerun_elsewhere,
        }[self.state]
        return step(_as_list(data_iterator))

    def _to(self, state: RerunState) -> None:
        self.state = check(self.state, state)

    def _begin_step(self, iterators: list[RerunDataIterator]) -> bool:
        mode = self.config.rerun_mode
        self._iterators = iterators
        # the RNG state at the start of the step, for the re-runs (not needed when off)
        self._rng_saved = RNGState().state_dict() if mode != "disabled" else None
        if mode != "disabled" and self.state_save_func is not None:
            self._user_saved = self.state_save_func()  # Megatron's custom state
        self._invocation, self._initial, self._rejected_here = 0, [], False
        self._injecting = bool(
            mode == "validate_results"
            and self.config.error_injection_rate
            and self._inject.randrange(self.config.error_injection_rate) == 0
        )
        self._to(RerunState.INITIAL_RUN)
        return True

    def _after_restart(self, iterators: list[RerunDataIterator]) -> bool:
        # only a rank whose result was doubted must have moved: the others' hardware
        # gave the results nobody doubted, and may well be the same as before
        here = hardware_id()
        if agree_any(self._failed_on is not None and here == self._failed_on, self.group):
            logger.warning("restarted on the same hardware: need a different GPU")
            if self._failed_on == here:
                self._ask_elsewhere(here)
            self._pending_exit = (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
            self._to(RerunState.WILL_RERUN_FROM_CHECKPOINT)
            return False
        self._iterators = iterators
        self._load_kept_batches(iterators)
        self._begin_rerun(RerunState.RERUNNING_FROM_CHECKPOINT)
        return True

    def _after_initial_run(self, iterators: list[RerunDataIterator]) -> bool:
        mode = self.config.rerun_mode
        if mode == "disabled":  # no collective at all: the loop body ran once
            return self._finish_step()
        if mode == "report_stats" or agree_any(self._rejected_here, self.group):
            self._begin_rerun(RerunState.RERUNNING_IN_PLACE)
            return True
        return self._finish_step()

    def _after_rerun_in_place(self, iterators: list[RerunDataIterator]) -> bool:
        if self.config.rerun_mode == "report_stats":
            return self._finish_step()
        not_reproduced, fatal = agree_flags([not self._reproduced, self._fatal], self.group)
        if not_reproduced:
            self._verdict(
                "transient",
                "First rerun: unexpected result is not reproducible "
                "within the tolerance\nPossible transient error!",
            )
            if fatal:
                self._pending_exit = (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
            return self._finish_step()
        logger.warning("First rerun: unexpected result is reproducible within the tolerance")
        logger.warning("Need to rerun on a different GPU to verify correctness")
        # the hardware to move away from: that of the rank(s) that doubted a result
        self._failed_on = hardware_id() if self._rejected_here else None
        if self._failed_on is not None:
            self._ask_elsewhere(self._failed_on)
        self._to(RerunState.WILL_RERUN_FROM_CHECKPOINT)
        resume_exactly()  # the checkpoint the loop saves now is resumed as it is
        self._pending_exit = (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        return False

    def _after_rerun_elsewhere(self, iterators: list[RerunDataIterator]) -> bool:
        not_reproduced, fatal = agree_flags([not self._reproduced, self._fatal], self.group)
        if not not_reproduced:
            self._verdict(
                "correct",
                "Second rerun: unexpected result is reproducible on a "
                "different GPU, therefore it was likely correct\n"
                "Correct result (but possible Application error)",
            )
            if fatal:
                self._pending_exit = (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
        else:
            self._verdict(
                "persistent",
                "Second rerun: unexpected result is not reproducible "
                "on a different GPU, therefore was likely incorrect\n"
                "Possible persistent error!",
            )
        return self._finish_step()

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """``(should_checkpoint, should_exit, exit_code)`` after the step's loop."""
        pending, self._pending_exit = self._pending_exit, (False, False, 0)
        return pending

    # ------------------------------------------------------------------ validation
    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str = "unexpected result",
        comparison_func: Callable[[float, float], float] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Check ``result`` (a number or 1-element tensor): on the initial run, reject it
        if ``rejection_func(result)``; on a re-run, compare it with the initial one."""
        mode = self.config.rerun_mode
        if mode == "disabled":
            return
        value = as_scalar(result)
        index = self._invocation
        self._invocation += 1
        compare = comparison_func or relative_difference
        if self.state == RerunState.INITIAL_RUN:
            rejected = bool(rejection_func(result)) or (self._injecting and index == 0)
            self._initial.append((value, rejected, message, fatal))
            if rejected and mode == "validate_results":
                self._rejected_here = True
                self._fatal = self._fatal or fatal
                rank = world_info().rank
                logger.warning(
                    "Unexpected result %s on rank %d at iteration #%d invocation #%d "
                    "(message='%s')",
                    value,
                    rank,
                    self.iteration,
                    index + 1,
                    message,
                )
                events.emit(
                    "rerun_result_rejected",
                    step=self.iteration,
                    cause=message,
                    result=value,
                    invocation=index + 1,
                )
                self._track(value, message, "rejected")
            return
        if index >= len(self._initial):
            return
        initial = self._initial[index][0]
        diff = compare(value, initial)
        if mode == "report_stats":
            self._diffs.append(diff)
            return
        injected = self._injection_outcome()
        if injected is not None:
            self._reproduced = self._reproduced and injected
        else:
            self._reproduced = self._reproduced and diff <= tolerance

    def validate_loss(self, loss: Any) -> None:
        """The seed's checks of a micro-batch's loss, as configured: NaN and Inf with
        ``check_for_nan_in_loss`` (fatal), a spike of ``spiky_loss_factor`` x the largest
        loss of the first 100 with ``check_for_spiky_loss`` (not fatal: a spike is often
        the data's)."""
        if self.config.rerun_mode == "disabled":
            return
        loss = as_scalar(loss)  # one host sync for every check
        if self.config.check_for_nan_in_loss:
            self.validate_result(
                loss, is_nan, "found NaN in local forward loss calculation", fatal=True
            )
            self.validate_result(
                loss, is_inf, "found Inf in local forward loss calculation", fatal=True
            )
        if self.config.check_for_spiky_loss:
            spiky = partial(
                self.is_unexpectedly_large, threshold=self.config.spiky_loss_factor, context="loss"
            )
            self.validate_result(loss, spiky, "Spiky loss", fatal=False)

    def is_unexpectedly_large(
        self, result: Any, threshold: float, context: str, num_samples: int = 100
    ) -> bool:
        """For spiky loss: True when ``|result| >= threshold x`` the max ``|value|`` of the
        first ``num_samples`` samples seen in ``context`` (False until then)."""
        value = abs(as_scalar(result))
        samples = self._large.setdefault(context, [])
        if len(samples) < num_samples:
            samples.append(value)
            return False
        return value >= threshold * max(samples)

    def get_stats(self) -> dict[str, float]:
        """``report_stats``: mean, p50, p90, p99 and max of the re-runs' relative
        differences so far."""
        if not self._diffs:
            return {"count": 0}
        data = sorted(self._diffs)

        def pct(p: float) -> float:
            return data[min(len(data) - 1, int(p * (len(data) - 1) + 0.5))]

        return {
            "count": len(data),
            "mean": sum(data) / len(data),
            "p50": pct(0.5),
            "p90": pct(0.9),
            "p99": pct(0.99),
            "max": data[-1],
        }

    # ------------------------------------------------------------------ Megatron's names
    @property
    def current_iteration(self) -> int:
        """The step being run (Megatron-LM's name for :attr:`iteration`)."""
        return self.iteration

    @current_iteration.setter
    def current_iteration(self, value: int) -> None:
        self.iteration = int(value)

    @property
    def mode(self) -> RerunMode:
        """The operating mode."""
        name = self.config.rerun_mode
        return RerunMode.REPORT_DETERMINISM_STATS if name == "report_stats" else RerunMode(name)

    def set_mode(self, mode: RerunMode | str) -> None:
        """Change the operating mode (Megatron-LM)."""
        self.config.rerun_mode = _mode(mode)
        require_choice("rerun_mode", self.config.rerun_mode, MODES)

    def get_mode(self) -> RerunMode:
        """The operating mode (Megatron-LM)."""
        return self.mode

    # ------------------------------------------------------------------ state
    def state_dict(
        self, data_iterator: Any = None, ckpt_format: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        """The machine's state for the checkpoint (continues an attribution after exit
        16), including the data iterators' kept batches. Megatron-LM's arguments are
        accepted: ``data_iterator`` (the iterators to keep, default the step's own),
        ``ckpt_format`` and ``force`` (the state is the same whatever the format, and
        always returned)."""
        if data_iterator is not None and self.state == RerunState.NOT_RUNNING_YET:
            self._iterators = _as_list(data_iterator) or self._iterators
        return {
            "state": self.state.value,
            "iteration": self.iteration,
            "failed_on": self._failed_on,
            "initial": [list(x) for x in self._initial],
            "fatal": self._fatal,
            "injected": self._injecting,
            "rng": self._rng_saved if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT else None,
            "iterators": [it.state_dict() for it in self._iterators],
            "large": {k: list(v) for k, v in self._large.items()},
        }

    def load_state_dict(self, state: dict[str, Any], data_iterator: Any = None) -> None:
        """Restore :meth:`state_dict`. The kept batches go into ``data_iterator`` when
        given, else into the iterators passed to the next :meth:`should_run_forward_backward`
        (so the machine can be restored as a plain ``Stateful`` by the checkpoint manager)."""
        try:
            self.state = RerunState(int(state["state"]))
            self.iteration = int(state["iteration"])
            self._initial = [
                (float(v), bool(r), str(m), bool(f)) for v, r, m, f in state["initial"]
            ]
            self._large = {str(k): [float(x) for x in v] for k, v in state.get("large", {}).items()}
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"rerun state: bad or missing field ({exc!r})") from exc
        if self.state not in (RerunState.NOT_RUNNING_YET, RerunState.WILL_RERUN_FROM_CHECKPOINT):
            raise ConfigError(
                f"rerun state: a checkpoint cannot be taken in state {self.state.name}"
            )
        self._failed_on = state.get("failed_on")
        self._fatal = bool(state.get("fatal", False))
        self._injecting = bool(state.get("injected", False))
        self._rng_saved = state.get("rng")
        self._pending_batches = list(state.get("iterators", []))
        iterators = _as_list(data_iterator)
        if iterators:
            self._load_kept_batches(iterators)

    # ------------------------------------------------------------------ internals
    def _load_kept_batches(self, iterators: list[RerunDataIterator]) -> None:
        """Hand the batches kept in a checkpoint to the iterators that replay them."""
        for it, kept in zip(iterators, self._pending_batches, strict=False):
            it.load_state_dict(kept)
        self._pending_batches = []

    def _begin_rerun(self, state: RerunState) -> None:
        if self._rng_saved is not None:
            RNGState().load_state_dict(self._rng_saved)
        if self.state_restore_func is not None and self._user_saved is not None:
            self.state_restore_func(self._user_saved)
        for it in self._iterators:
            it.rewind()
        self._invocation = 0
        self._reproduced = True
        self._to(state)

    def _finish_step(self) -> bool:
        for it in self._iterators:
            it.advance()
        self._to(RerunState.NOT_RUNNING_YET)
        self._initial, self._fatal, self._injecting = [], False, False
        self.iteration += 1
        return False

    def _injection_outcome(self) -> bool | None:
        """Whether an injected error reproduces in the current re-run (None: not one)."""
        if not self._injecting:
            return None
        kind = self.config.error_injection_type
        if self.state == RerunState.RERUNNING_IN_PLACE:
            return kind != "transient_error"
        return kind == "correct_result"

    def _ask_elsewhere(self, hardware: str) -> None:
        """This rank's result must be re-checked on other hardware: the event names the
        hardware (and, through its host, the node) that the launcher asks Slurm to keep
        the requeued job away from."""
        events.emit("rerun_elsewhere", step=self.iteration, cause="reproduced", hardware=hardware)

    def _verdict(self, kind: str, text: str) -> None:
        if self.bad_restore is not None and kind in ("persistent", "correct"):
            kind, text = "bad_restore", f"{text}\nNo verdict: {self.bad_restore}"
        for line in text.splitlines():
            logger.warning("%s", line)
        self.verdicts.append(kind)
        events.emit("rerun_verdict", step=self.iteration, cause=kind, verdict=kind)
        self._track(None, text.splitlines()[-1], kind)

    def _track(self, result: float | None, message: str, status: str) -> None:
        track(self.config.result_rejected_tracker_filename, self.iteration, result, message, status)


def _as_list(data_iterator: Any) -> list[RerunDataIterator]:
    if data_iterator is None:
        return []
    items = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    return [it for it in items if isinstance(it, RerunDataIterator)]


_GLOBAL: RerunStateMachine | None = None


def note_bad_restore(step: int, tier: str, text: str) -> None:
    """A restore failed its replay proof (:mod:`steadfast.checkpoint.proof`): the
    process's machine, if one runs, hears "a bad restore", not "a bad GPU". Its verdict
    ``bad_restore`` voids what it concluded since that restore (a re-run compared with a
    state that was not the one lost proves nothing about the hardware), and its later
    re-runs conclude nothing until a restore is proven."""
    machine = _GLOBAL
    if machine is None or machine.mode == RerunMode.DISABLED:
        return
    machine.bad_restore = text
    machine._verdict("bad_restore", f"Restore of step {step} ({tier}) not proven\n{text}")


on_bad_restore(note_bad_restore)


def initialize_rerun_state_machine(**kwargs: Any) -> RerunStateMachine:
    """Make the process's re-run state machine (Megatron-LM's singleton; the keyword
    arguments of :class:`RerunStateMachine`)."""
    global _GLOBAL
    _GLOBAL = RerunStateMachine(**kwargs)
    return _GLOBAL


def get_rerun_state_machine() -> RerunStateMachine:
    """The process's re-run state machine, made disabled when none was initialized (as
    Megatron-LM does, with a warning): the seed's ``train_step`` calls this."""
    global _GLOBAL
    if _GLOBAL is None:
        logger.warning("Implicit initialization of the re-run state machine (disabled)")
        _GLOBAL = RerunStateMachine()
    return _GLOBAL


def destroy_rerun_state_machine() -> None:
    """Forget the process's re-run state machine."""
    global _GLOBAL
    _GLOBAL = None
