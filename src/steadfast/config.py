"""Configuration errors and validation helpers shared by every steadfast component.

Bad input (a config field, a flag, a state file) must produce one readable error that
names the field, never a traceback from deep inside and never a silent default. Every
validation in steadfast raises :class:`ConfigError` through the helpers here.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .node_settings import STRING_FIELDS, NodeSettings
from .validate import (
    ConfigError,
    _MissingSection,
    parse_signal,
    require_bool,
    require_choice,
    require_number,
    require_timeout,
)

__all__ = [
    "ConfigError",
    "FaultToleranceConfig",
    "parse_signal",
    "require_choice",
    "require_number",
]

logger = logging.getLogger("steadfast.config")


# ---------------------------------------------------------------------------------------
# Fault tolerance (in-job restart) configuration
# ---------------------------------------------------------------------------------------
@dataclass
class FaultToleranceConfig(NodeSettings):
    """Settings of the rank monitors and the launcher's restart policy.

    The fields and defaults of NVIDIA Resiliency Extension's ``FaultToleranceConfig``
    (seed 002; NVRx 0.4.1's defaults: a first heartbeat within an hour, then one every 45
    minutes), its loaders (:meth:`from_kwargs`, :meth:`from_yaml_file`,
    :meth:`from_args`, :meth:`to_yaml_file`), plus the launcher's stop grace period and
    progress guard. A timeout of ``None`` (YAML ``null``) is infinite: it never fires,
    so it must be calculated from observed intervals (``calculate_and_set_*_timeouts``)
    to be useful. The checks a node passes before it is trusted, and the node ledger,
    are :class:`~steadfast.node_settings.NodeSettings`' fields.

    Attributes:
        workload_check_interval: Longest the launcher's watcher sleeps between looks at
            the heartbeat table. Unlike the original, which polls at this interval (so a
            hang is seen up to 5 s late), the watcher sleeps until the nearest deadline.
        initial_rank_heartbeat_timeout: Time allowed until a rank's first heartbeat.
        rank_heartbeat_timeout: Time allowed between heartbeats.
        rank_section_timeouts: Section name -> time allowed inside it. The ``warmup``
            entry, if given, replaces ``step`` for the first ``num_warmup_iterations``.
        rank_out_of_section_timeout: Time allowed outside any section (checked from the
            first ``step`` section on).
        safety_factor: Calculated timeout = safety_factor x max observed interval (> 0;
            below 1 is allowed, as in NVRx, with a warning).
        rank_termination_signal: How a hung rank is terminated.
        log_level: Log level of the monitors and launcher: a ``logging`` level number,
            as NVRx stores it (``"INFO"``, ``"warn"``... are accepted and converted).
        num_warmup_iterations: Iterations that use the ``warmup`` timeout.
        workers_stop_timeout: Grace period between SIGTERM and SIGKILL when the workers
            are stopped for a restart or a shutdown.
        max_no_progress_restarts: Stop restarting (exit code 76) after this many
            consecutive restarts in which no rank completed a step; 0 disables the guard.
        num_job_retries_on_failure: Job retries (Megatron Bridge's name): when the
            in-job restarts are spent under Slurm, requeue the job while its failure
            requeues so far (``job_requeued`` events in the run's event log; preemptions
            do not count) are below this (exit code 78); 0 never requeues.
        worker_template: Start script workers by forking a template process that has
            imported torch already, so a (re)start does not pay ``import torch`` again.
        node_heartbeat_interval: How often each node's launcher tells the launchers
            that watch it (two per node, in a ring over the round's nodes) that it is
            alive. A node killed outright is seen at once (its connections reset); this
            bounds how late a node that goes silent (power, NIC, partition) is seen.
        node_heartbeat_timeout: A watched node silent for this long is lost; also how
            long a checkpoint write waits for the launcher to confirm the node still
            holds the rendezvous (the fence).
        node_lost_timeout: After a node is lost, how long the survivors wait for enough
            nodes (a spare, or an elastic minimum) to form the next round; then the
            launcher exits 75 (node lost) instead of waiting out the rendezvous'
            ``join_timeout`` (600 s).
        job_end_timeout: Once another node of the round finished its workers, how long
            this node's workers may go on: past it they are taken for hung at the job's
            end (``rank_hung``, cause ``job_end``), stopped, and the launcher exits 79.
            Also the most a finished node waits in the exit barrier for the others,
            whatever the round looks like from there (it then leaves, naming the nodes
            it did not hear from). Raise it where the last rank's own final work (a
            final save that only it does, say) takes longer.
        teardown_timeout: How long a worker whose script has finished (its
            ``__main__`` returned, or ``sys.exit(0)``) may take to exit: non-daemon
            threads, ``atexit`` handlers, the interpreter's teardown. Past it the worker
            is killed and taken as finished (``worker_teardown``, a warning): the
            training is not run again. A finished worker that dies of a signal in its
            teardown is finished too. Raise it where a script's own threads go on
            writing after ``__main__`` returns.
        learn_timeouts: Learn hang timeouts online (steadfast's default; ``false`` opts
            out): each section's, the time out of sections' and the heartbeat's, from
            the intervals the ranks report, wherever the config leaves them at their
            defaults. Until a timeout has ``learned_timeout_min_samples`` intervals the
            defaults apply (an unnamed section: none); then it is
            ``learned_timeout_margin`` x the longest interval seen (the first of each
            process left out: a warm-up), never below ``learned_timeout_floor`` (the
            heartbeat's never above its default). Kept across in-job restarts by the
            launcher and across job restarts in ``learned_timeouts.json`` beside the
            event log. See
            docs/learned-timeouts.md for why, and the worst case.
        learned_timeout_margin: A learned timeout is this many times the longest
            interval seen.
        learned_timeout_floor: The least a learned timeout can be (seconds).
        calculated_timeout_floor: The least a calculated timeout is enforced at
            (seconds; ``calculate_and_set_*_timeouts`` and a loaded ``ft_state.json``
            keep the value calculated, the watcher waits at least this long; 0: no
            floor). Back-to-back sections see microseconds outside them, and
            safety_factor x that would end a healthy rank at its first pause.
        learned_timeout_min_samples: Intervals seen before a learned timeout applies.
        watch_progress: See a plain script's progress without a line of it
            (steadfast's default; ``--ft-watch-progress false`` opts out): every worker
            counts its optimizer steps and times its top module's forward into its row
            of the heartbeat table, and the launcher takes a learned silence, confirmed
            from ``/proc`` and the ranks' stacks, for a hang, names its culprit, logs
            the steps and reports stragglers (steadfast.progress).
        progress_startup_bound: How long every worker of the node may show no sign of
            life (no CPU, no I/O, no stack moving) before its first step (seconds):
            past it the start-up is taken for hung (a first step's bound is unknown).
        progress_cap: The most a worker may go on without a step or a forward while
            it moves (a livelock, an evaluation that never ends), in seconds, and the
            most a node whose ranks all wait in collectives waits for another node to
            name the culprit (a learned or start-up bound is never longer).
        replica_check: Compare the fingerprints of a DDP model's replicas (its
            parameters and optimizer state) out of band, and stop the job with a
            verdict when one replica's state silently differs (steadfast.sdc; needs
            watch_progress). ``--ft-replica-check false`` opts out.
        replica_check_every: Optimizer steps between two checks of a replica's state.
        replica_check_bytes: The most bytes of state one check hashes; a larger state
            is covered in chunks, one per check.
    """

    workload_check_interval: float = 5.0
    initial_rank_heartbeat_timeout: float | None = 60.0 * 60.0
    rank_heartbeat_timeout: float | None = 45.0 * 60.0
    rank_section_timeouts: dict[str, float | None] = field(default_factory=dict)
    rank_out_of_section_timeout: float | None = None
    safety_factor: float = 5.0
    rank_termination_signal: signal.Signals = signal.SIGKILL
    log_level: int = logging.INFO
    num_warmup_iterations: int = 5
    workers_stop_timeout: float = 15.0
    max_no_progress_restarts: int = 3
    num_job_retries_on_failure: int = 0
    worker_template: bool = True
    node_heartbeat_interval: float = 0.5
    node_heartbeat_timeout: float = 5.0
    node_lost_timeout: float = 60.0
    job_end_timeout: float = 60.0
    teardown_timeout: float = 30.0
    learn_timeouts: bool = True
    learned_timeout_margin: float = 3.0
    learned_timeout_floor: float = 5.0
    calculated_timeout_floor: float = 1.0
    learned_timeout_min_samples: int = 8
    watch_progress: bool = True
    progress_startup_bound: float = 300.0
    progress_cap: float = 600.0
    replica_check: bool = True
    replica_check_every: int = 10
    replica_check_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; one :class:`ConfigError` names the first bad one."""
        p = "fault_tolerance."
        self.workload_check_interval = float(
            require_number(
                p + "workload_check_interval", self.workload_check_interval, exclusive_minimum=0
            )
        )
        self.initial_rank_heartbeat_timeout = require_timeout(
            p + "initial_rank_heartbeat_timeout", self.initial_rank_heartbeat_timeout
        )
        self.rank_heartbeat_timeout = require_timeout(
            p + "rank_heartbeat_timeout", self.rank_heartbeat_timeout
        )
        if not isinstance(self.rank_section_timeouts, Mapping):
            raise ConfigError(
                f"{p}rank_section_timeouts: expected a mapping of section name to "
                f"seconds, got {self.rank_section_timeouts!r}"
            )
        sections: dict[str, float | None] = {}
        for name, value in self.rank_section_timeouts.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{p}rank_section_timeouts: bad section name {name!r}")
            sections[name] = require_timeout(f"{p}rank_section_timeouts.{name}", value)
        self.rank_section_timeouts = sections
        self.rank_out_of_section_timeout = require_timeout(
            p + "rank_out_of_section_timeout", self.rank_out_of_section_timeout
        )
        self.safety_factor = float(
            require_number(p + "safety_factor", self.safety_factor, exclusive_minimum=0)
        )
        if self.safety_factor < 1:  # valid (NVRx takes it), but almost surely a mistake
            logger.warning(
                "%ssafety_factor=%g < 1: calculated timeouts will be shorter than the "
                "longest interval seen, so a healthy rank may be taken for hung",
                p,
                self.safety_factor,
            )
        self.rank_termination_signal = parse_signal(
            self.rank_termination_signal, p + "rank_termination_signal"
        )
        self.log_level = _log_level(p + "log_level", self.log_level)
        self.num_warmup_iterations = require_number(
            p + "num_warmup_iterations", self.num_warmup_iterations, minimum=0, integer=True
        )
        self.workers_stop_timeout = float(
            require_number(p + "workers_stop_timeout", self.workers_stop_timeout, minimum=0)
        )
        self.worker_template = require_bool(p + "worker_template", self.worker_template)
        self.learn_timeouts = require_bool(p + "learn_timeouts", self.learn_timeouts)
        self.learned_timeout_margin = float(
            require_number(p + "learned_timeout_margin", self.learned_timeout_margin, minimum=1)
        )
        self.learned_timeout_floor = float(
            require_number(
                p + "learned_timeout_floor", self.learned_timeout_floor, exclusive_minimum=0
            )
        )
        self.calculated_timeout_floor = float(
            require_number(p + "calculated_timeout_floor", self.calculated_timeout_floor, minimum=0)
        )
        self.watch_progress = require_bool(p + "watch_progress", self.watch_progress)
        for name in ("progress_startup_bound", "progress_cap"):
            value = require_number(p + name, getattr(self, name), exclusive_minimum=0)
            setattr(self, name, float(value))
        self.replica_check = require_bool(p + "replica_check", self.replica_check)
        for name in ("replica_check_every", "replica_check_bytes"):
            value = require_number(p + name, getattr(self, name), minimum=1, integer=True)
            setattr(self, name, int(value))
        self.learned_timeout_min_samples = require_number(
            p + "learned_timeout_min_samples",
            self.learned_timeout_min_samples,
            minimum=1,
            integer=True,
        )
        self.num_job_retries_on_failure = require_number(
            p + "num_job_retries_on_failure",
            self.num_job_retries_on_failure,
            minimum=0,
            integer=True,
        )
        self.max_no_progress_restarts = require_number(
            p + "max_no_progress_restarts",
            self.max_no_progress_restarts,
            minimum=0,
            integer=True,
        )
        for name in (
            "node_heartbeat_interval",
            "node_heartbeat_timeout",
            "node_lost_timeout",
            "job_end_timeout",
            "teardown_timeout",
        ):
            value = require_number(p + name, getattr(self, name), exclusive_minimum=0)
            setattr(self, name, float(value))
        if self.node_heartbeat_timeout <= self.node_heartbeat_interval:
            raise ConfigError(
                f"{p}node_heartbeat_timeout ({self.node_heartbeat_timeout:g}) must be longer "
                f"than node_heartbeat_interval ({self.node_heartbeat_interval:g})"
            )
        self.validate_node_settings(p)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_mapping(
        cls,
        values: Mapping[str, Any],
        source: str = "config",
        ignore_not_recognized: bool = False,
    ) -> FaultToleranceConfig:
        """Build from a mapping (a YAML section). An unknown key is an error naming it,
        or, with ``ignore_not_recognized``, a warning naming it (NVRx's loaders ignore
        them silently: a misspelt timeout then has no effect without a word)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown and not ignore_not_recognized:
            raise ConfigError(
                f"{source}: unknown fault_tolerance field(s) {unknown}; known: {sorted(known)}"
            )
        if unknown:
            logger.warning(
                "%s: fault_tolerance field(s) %s not recognized: ignored", source, unknown
            )
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_kwargs(cls, ignore_not_recognized: bool = True, **kwargs: Any) -> FaultToleranceConfig:
        """NVRx's constructor from keyword arguments: unknown ones are ignored (with a
        warning naming them) unless ``ignore_not_recognized=False``, which raises."""
        return cls.from_mapping(kwargs, "FaultToleranceConfig.from_kwargs", ignore_not_recognized)

    @classmethod
    def from_yaml_file(
        cls, cfg_path: str | os.PathLike[str], ignore_not_recognized: bool = True
    ) -> FaultToleranceConfig:
        """Read the ``fault_tolerance:`` section of a YAML file, found at any depth (so a
        whole training config with the section somewhere inside works, as in NVRx).
        Unknown fields are ignored with a warning (``ignore_not_recognized=False``: an
        error naming them)."""
        import yaml

        try:
            with open(cfg_path) as fh:
                doc = yaml.safe_load(fh)
        except OSError as exc:
            raise ConfigError(f"{cfg_path}: cannot read the FT config ({exc})") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{cfg_path}: not valid YAML ({exc})") from exc
        section = _find_section(doc, "fault_tolerance")
        if section is None:
            raise _MissingSection(f"{cfg_path}: no 'fault_tolerance:' section")
        if not isinstance(section, Mapping):
            raise ConfigError(f"{cfg_path}: the 'fault_tolerance:' section is not a mapping")
        return cls.from_mapping(section, str(cfg_path), ignore_not_recognized)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultToleranceConfig:
        """NVRx's ``from_args``: the defaults, then the YAML file of ``args.ft_cfg_path``
        (if it has a ``fault_tolerance`` section), then every ``args.ft_<field>`` that is
        not None (``rank_section_timeouts`` may be the flag's ``name:secs,...`` string).
        With neither a file section nor any ``ft_*`` value it is an error, as in NVRx,
        unless ``args.ft_ignore_missing_cfg``."""
        base = cls()
        from_file = False
        path = getattr(args, "ft_cfg_path", None)
        if path is not None:
            try:
                base = cls.from_yaml_file(path)
                from_file = True
            except ConfigError as exc:
                if not exc.missing_section:
                    raise
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        given: dict[str, Any] = {}
        for f in fields(cls):
            value = getattr(args, f"ft_{f.name}", None)
            if f.name == "workers_stop_timeout" and value is None:  # NVRx's launcher flag
                value = getattr(args, "workers_stop_timeout", None)
            if value is None:
                continue
            if isinstance(value, str):  # the flag's text (steadfast's get_args_parser)
                value = _parse_flag(f"--ft-{f.name.replace('_', '-')}", f.name, value)
            given[f.name] = value
        if not (from_file or given or getattr(args, "ft_ignore_missing_cfg", False)):
            raise ConfigError(
                "no fault tolerance configuration: give --ft-cfg-path FILE (with a "
                "fault_tolerance: section) or --ft-* flags"
            )
        return cls(**{**values, **given})

    def to_yaml_file(self, cfg_path: str | os.PathLike[str]) -> None:
        """Write this config as a YAML file with a ``fault_tolerance:`` section (the
        signal by name, the log level as a number), which :meth:`from_yaml_file` reads
        back equal."""
        import yaml

        out = self.to_dict()
        with open(cfg_path, "w") as fh:
            yaml.safe_dump({"fault_tolerance": out}, fh, sort_keys=False)

    def with_overrides(self, overrides: Mapping[str, str]) -> FaultToleranceConfig:
        """A copy with fields set from command-line strings (``--ft-param-<field>=VALUE``):
        ``null``/``none`` is None, ``a:1,b:2`` is a mapping, numbers are numbers."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, raw in overrides.items():
            if name not in values:
                raise ConfigError(
                    f"--ft-param-{name}: unknown fault_tolerance field; known: {sorted(values)}"
                )
            values[name] = _parse_flag(f"--ft-param-{name}", name, raw)
        return type(self)(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (the signal by name), e.g. to pass to the workers as JSON."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rank_termination_signal"] = self.rank_termination_signal.name
        out["rank_section_timeouts"] = dict(self.rank_section_timeouts)
        return out


_LOG_LEVELS = {
    "DEBUG": logging.DEBUG,
    "DBG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
    "FATAL": logging.CRITICAL,
}


def _log_level(field: str, value: Any) -> int:
    """A ``logging`` level number from a number or a name (NVRx stores the number)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if logging.DEBUG <= value <= logging.CRITICAL:
            return value
        raise ConfigError(
            f"{field}: {value} is not a log level ({logging.DEBUG} DEBUG .. "
            f"{logging.CRITICAL} CRITICAL)"
        )
    if isinstance(value, str):
        text = value.strip().upper()
        if text.isdigit():
            return _log_level(field, int(text))
        if text in _LOG_LEVELS:
            return _LOG_LEVELS[text]
    raise ConfigError(
        f"{field}: {value!r} is not a log level; expected one of "
        f"{', '.join(n for n in _LOG_LEVELS if n not in ('DBG', 'WARN', 'FATAL'))} or a number"
    )


def _find_section(doc: Any, name: str) -> Any:
    """The first ``name:`` entry at any depth of a YAML document (depth first)."""
    if isinstance(doc, Mapping):
        if name in doc:
            return doc[name]
        for value in doc.values():
            found = _find_section(value, name)
            if found is not None:
                return found
    elif isinstance(doc, list):
        for item in doc:
            found = _find_section(item, name)
            if found is not None:
                return found
    return None


def _scalar(raw: str) -> Any:
    text = raw.strip()
    if text.lower() in ("null", "none", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


#: Fields whose command-line value is taken as written (a command, a path).
_STRING_FIELDS = STRING_FIELDS


def _parse_flag(flag: str, name: str, raw: str) -> Any:
    if name in _STRING_FIELDS:
        return None if raw.strip().lower() in ("null", "none") else raw
    if name == "rank_section_timeouts":
        out: dict[str, Any] = {}
        if raw.strip() in ("", "{}"):
            return out
        for item in raw.split(","):
            key, sep, value = item.partition(":")
            if not sep or not key.strip():
                raise ConfigError(f"{flag}: expected name:seconds[,name:seconds...], got {raw!r}")
            out[key.strip()] = _scalar(value)
        return out
    return _scalar(raw)
