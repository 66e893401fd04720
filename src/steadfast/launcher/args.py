"""Command line of ``steadfast launch``: every torchrun flag, plus the FT config flags.

The FT flags (``--ft-cfg-path FILE``, ``--ft-param-<field>=VALUE`` and
``--ft-<field> VALUE``, with ``_`` or ``-`` in field names) and the event-log flags
(``--events PATH``, ``--run-dir DIR``) are taken out of the launcher's part of the
command line (everything before the training script); the rest goes to torchrun's own
parser unchanged. Nothing after the training script's path is ever taken by the
launcher: those are the script's flags.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from ..config import ConfigError, FaultToleranceConfig

__all__ = ["DEFAULT_EVENTS_NAME", "LaunchArgs", "resolve_events_path", "split_argv"]

#: The run's event log inside ``--run-dir``.
DEFAULT_EVENTS_NAME = "events.jsonl"
_EVENT_FLAGS = ("--events", "--run-dir")

_FT_FIELDS = {f.name for f in fields(FaultToleranceConfig)}


@dataclass
class LaunchArgs:
    """The launcher's command line, split: torchrun's flags and the FT config."""

    torchrun_argv: list[str]
    ft: FaultToleranceConfig
    #: ``--events PATH``: the run's event log (None: not given)
    events: str | None = None
    #: ``--run-dir DIR``: the run's folder; its log is ``DIR/events.jsonl``
    run_dir: str | None = None


def resolve_events_path(
    events: str | None, run_dir: str | None, environ: dict[str, str] | None = None
) -> str:
    """The run's event log, decided once by the launcher for every worker of every
    restart: ``--events PATH``, else ``--run-dir DIR`` (``DIR/events.jsonl``), else an
    inherited ``$STEADFAST_EVENTS`` (the batch script of ``steadfast slurm`` sets it;
    ``off`` stays off), else ``steadfast_events.jsonl`` in the working directory. A
    path is made absolute, so a worker that changes directory writes to the same file.
    """
    from .. import events as ev

    env = os.environ if environ is None else environ
    if events is not None and run_dir is not None:
        raise ConfigError("--events and --run-dir: give one of them, not both")
    inherited = env.get(ev.EVENTS_ENV)
    if events is not None:
        chosen = events
    elif run_dir is not None:
        chosen = os.path.join(run_dir, DEFAULT_EVENTS_NAME)
    elif inherited:
        chosen = inherited
    else:
        chosen = ev.DEFAULT_EVENTS_FILE
    if not chosen:
        raise ConfigError("--events: needs a path")
    return chosen if chosen == ev.EVENTS_OFF else os.path.abspath(chosen)


def _takes_value(parser: argparse.ArgumentParser, option: str) -> bool:
    actions = parser._option_string_actions  # torchrun's own option table
    action = actions.get(option)
    if action is None and option.startswith("--"):  # argparse accepts unique prefixes
        matches = {id(a): a for name, a in actions.items() if name.startswith(option)}
        action = next(iter(matches.values())) if len(matches) == 1 else None
    return action is not None and action.nargs != 0


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> LaunchArgs:
    """Separate the FT flags from torchrun's flags (``parser``) in the launcher's part of
    ``argv``; build the :class:`FaultToleranceConfig` (YAML file first, then flags)."""
    torchrun: list[str] = []
    overrides: dict[str, str] = {}
    cfg_path: str | None = None
    taken: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            torchrun.extend(argv[i:])
            break
        flag, eq, value = token.partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag  # as torchrun's
        if flag in _EVENT_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{token}: needs a value")
                value = argv[i + 1]
                i += 1
            if not value:
                raise ConfigError(f"{flag}: needs a non-empty path")
            taken[flag] = value
            i += 1
            continue
        if token.startswith("--ft-"):
            name, eq, value = token[len("--ft-") :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{token}: needs a value")
                value = argv[i + 1]
                i += 1
            i += 1
            if name in ("cfg-path", "cfg_path"):
                cfg_path = value
                continue
            field = name.removeprefix("param-").replace("-", "_")
            if field not in _FT_FIELDS:
                raise ConfigError(
                    f"{token}: unknown fault_tolerance field {field!r}; known: {sorted(_FT_FIELDS)}"
                )
            overrides[field] = value
            continue
        if not token.startswith("-") or token in ("-m", "--module", "--no-python", "--no_python"):
            if token.startswith("-"):  # a flag without a value, then the script
                torchrun.append(token)
                i += 1
            torchrun.extend(argv[i:])  # the training script and its own flags
            break
        torchrun.append(token)
        if "=" not in token and _takes_value(parser, token) and i + 1 < len(argv):
            torchrun.append(argv[i + 1])
            i += 1
        i += 1
    base = FaultToleranceConfig.from_yaml_file(cfg_path) if cfg_path else FaultToleranceConfig()
    return LaunchArgs(
        torchrun,
        base.with_overrides(overrides) if overrides else base,
        events=taken.get("--events"),
        run_dir=taken.get("--run-dir"),
    )
