"""Command line of ``steadfast launch``: every torchrun flag, plus steadfast's own.

steadfast's flags are taken out of the launcher's part of the command line (everything
before the training script); the rest goes to torchrun's own parser unchanged. Nothing
after the training script's path is ever taken by the launcher: those are the script's
flags. steadfast's flags, with NVRx ``ft_launcher``'s names (``_`` or ``-`` alike):

- ``--ft-cfg-path FILE`` (also ``--fault-tol-cfg-path``): a YAML file whose
  ``fault_tolerance:`` section (at any depth) is the FT config;
- ``--ft-<field> VALUE`` / ``--ft-param-<field>=VALUE``: one FT config field
  (``null`` is an infinite timeout), over the file;
- ``--workers-stop-timeout S``: the FT field of that name (SIGTERM to SIGKILL when the
  workers are stopped for a restart);
- ``--term-timeout S``: SIGTERM to SIGKILL when the launcher passes a signal it got to
  its workers (default: ``workers_stop_timeout``);
- ``--ft-restart-policy any-failed``: restart every node's workers when any fails
  (torchrun's policy, the only one: ``min-healthy`` is refused with the reason);
- ``--ignore-missing-fault-tol-cfg``: accepted; steadfast never requires a config (with
  none, the defaults apply);
- ``--events PATH`` / ``--run-dir DIR``: the run's event log (see :func:`resolve_events_path`).

:func:`get_args_parser` is torchrun's parser with all of these declared, for ``--help``
and for code written against NVRx's ``get_args_parser``; with
:meth:`FaultToleranceConfig.from_args <steadfast.FaultToleranceConfig.from_args>` it
gives the same config as the launcher.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields

from ..config import ConfigError, FaultToleranceConfig

__all__ = [
    "DEFAULT_EVENTS_NAME",
    "RESTART_POLICIES",
    "LaunchArgs",
    "get_args_parser",
    "resolve_events_path",
    "split_argv",
]

#: The run's event log inside ``--run-dir``.
DEFAULT_EVENTS_NAME = "events.jsonl"
#: NVRx's ``--ft-restart-policy`` values; steadfast implements the first.
RESTART_POLICIES = ("any-failed", "min-healthy")

_FT_FIELDS = {f.name for f in fields(FaultToleranceConfig)}
#: steadfast's flags that take a value (canonical spelling -> what it sets)
_VALUE_FLAGS = {
    "--events": "events",
    "--run-dir": "run_dir",
    "--ft-cfg-path": "cfg_path",
    "--fault-tol-cfg-path": "cfg_path",
    "--term-timeout": "term_timeout",
    "--workers-stop-timeout": "ft:workers_stop_timeout",
    "--ft-restart-policy": "restart_policy",
    "--restart-policy": "restart_policy",
    "--metrics-port": "metrics_port",
    "--metrics-addr": "metrics_addr",
    "--metrics-sd-dir": "metrics_sd_dir",
}
#: steadfast's flags without a value
_SWITCHES = {"--ignore-missing-fault-tol-cfg": "ignore_missing_cfg"}


@dataclass
class LaunchArgs:
    """The launcher's command line, split: torchrun's flags and steadfast's."""

    torchrun_argv: list[str]
    ft: FaultToleranceConfig
    #: ``--events PATH``: the run's event log (None: not given)
    events: str | None = None
    #: ``--run-dir DIR``: the run's folder; its log is ``DIR/events.jsonl``
    run_dir: str | None = None
    #: ``--term-timeout``: seconds between SIGTERM and SIGKILL for a passed-on signal
    term_timeout: float | None = None
    #: ``--ft-restart-policy``
    restart_policy: str = "any-failed"
    #: torchrun's flags before the training script (where ``-h`` asks for help)
    launcher_flags: list[str] = field(default_factory=list)
    #: ``--metrics-port``: the Prometheus endpoint's port (0: a free one; None: none)
    metrics_port: int | None = None
    #: ``--metrics-addr``: the address it listens on (default: every address)
    metrics_addr: str = ""
    #: ``--metrics-sd-dir``: where its file_sd target file goes
    metrics_sd_dir: str | None = None
    #: where the training script is in ``torchrun_argv`` (None: not found)
    script_at: int | None = None

    def parse(self, parser: argparse.ArgumentParser) -> argparse.Namespace:
        """torchrun's namespace: ``parser`` reads the flags and the script; the script's
        own arguments are its ``training_script_args`` as they are. (argparse looks at
        every option-like word, so under Python < 3.12 a script flag that abbreviates
        a launcher flag, such as ``--signal`` for ``--signals-to-handle``, would be
        "ambiguous" in plain torchrun: here it is never shown to the parser.)"""
        if self.script_at is None:
            return parser.parse_args(self.torchrun_argv)
        args = parser.parse_args(self.torchrun_argv[: self.script_at + 1])
        args.training_script_args = self.torchrun_argv[self.script_at + 1 :]
        return args


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
    from .. import seam

    actions = seam.option_actions(parser)  # torchrun's parser's option table
    action = actions.get(option)
    if action is None and option.startswith("--"):  # argparse accepts unique prefixes
        matches = {id(a): a for name, a in actions.items() if name.startswith(option)}
        action = next(iter(matches.values())) if len(matches) == 1 else None
    return action is not None and action.nargs != 0


def _seconds(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{flag}: expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{flag}: expected seconds >= 0, got {text!r}")
    return value


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> LaunchArgs:
    """Separate steadfast's flags from torchrun's flags (``parser``) in the launcher's
    part of ``argv``; build the :class:`FaultToleranceConfig` (the YAML file first, then
    the flags). A bad flag or value is one :class:`ConfigError` naming it."""
    torchrun: list[str] = []
    before: list[str] | None = None  # torchrun's flags before the script
    script_at: int | None = None
    overrides: dict[str, str] = {}
    taken: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            torchrun.extend(argv[i:])
            break
        flag, eq, value = token.partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag  # as torchrun's
        if flag in _SWITCHES:
            taken[_SWITCHES[flag]] = "1"
            i += 1
            continue
        target = _VALUE_FLAGS.get(flag)
        if target is None and flag.startswith("--ft-"):
            name = flag[len("--ft-") :].removeprefix("param-").replace("-", "_")
            if name not in _FT_FIELDS:
                raise ConfigError(
                    f"{token}: unknown fault_tolerance field {name!r}; known: {sorted(_FT_FIELDS)}"
                )
            target = "ft:" + name
        if target is not None:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{token}: needs a value")
                value = argv[i + 1]
                i += 1
            i += 1
            if target.startswith("ft:"):
                overrides[target[3:]] = value
            elif not value:
                raise ConfigError(f"{flag}: needs a non-empty value")
            else:
                taken[target] = value
            continue
        if not token.startswith("-") or token in ("-m", "--module", "--no-python", "--no_python"):
            before = list(torchrun)
            if token.startswith("-"):  # a flag without a value, then the script
                torchrun.append(token)
                i += 1
            script_at = len(torchrun) if i < len(argv) else None
            torchrun.extend(argv[i:])  # the training script and its own flags
            break
        torchrun.append(token)
        if "=" not in token and _takes_value(parser, token) and i + 1 < len(argv):
            torchrun.append(argv[i + 1])
            i += 1
        i += 1
    cfg_path = taken.get("cfg_path")
    base = FaultToleranceConfig()
    if cfg_path is not None:
        try:
            base = FaultToleranceConfig.from_yaml_file(cfg_path)
        except ConfigError as exc:
            # NVRx: a file without the section is fine when flags give the config
            if not (exc.missing_section and (overrides or "ignore_missing_cfg" in taken)):
                raise
    policy = taken.get("restart_policy", RESTART_POLICIES[0])
    if policy not in RESTART_POLICIES:
        raise ConfigError(f"--ft-restart-policy: {policy!r}; expected one of {RESTART_POLICIES}")
    if policy != "any-failed":
        raise ConfigError(
            "--ft-restart-policy min-healthy: not supported; steadfast restarts every "
            "node's workers when any fails (any-failed), and keeps a job of fewer nodes "
            "going with an elastic --nnodes MIN:MAX instead"
        )
    term = taken.get("term_timeout")
    port = taken.get("metrics_port")
    if port is not None and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ConfigError(f"--metrics-port: {port!r} is not a TCP port (0 for a free one)")
    return LaunchArgs(
        torchrun,
        base.with_overrides(overrides) if overrides else base,
        events=taken.get("events"),
        run_dir=taken.get("run_dir"),
        term_timeout=_seconds("--term-timeout", term) if term is not None else None,
        restart_policy=policy,
        launcher_flags=before if before is not None else list(torchrun),
        metrics_port=int(port) if port is not None else None,
        metrics_addr=taken.get("metrics_addr", ""),
        metrics_sd_dir=taken.get("metrics_sd_dir"),
        script_at=script_at,
    )


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser with steadfast's flags declared (NVRx's
    ``ft_launcher.get_args_parser``): ``parse_args`` gives torchrun's attributes plus
    ``ft_cfg_path``, ``ft_<field>`` for every FT config field (as the text given, or
    None), ``term_timeout``, ``workers_stop_timeout``, ``ft_restart_policy``,
    ``ft_ignore_missing_cfg``, ``events`` and ``run_dir``; ``FaultToleranceConfig.
    from_args(args)`` builds the config from them. (``steadfast launch`` itself reads
    its flags with :func:`split_argv`, which gives one clear error per bad flag, and
    torchrun's own parser: with these declared, a script flag that abbreviates one of
    them, such as ``--fault``, would be "ambiguous" to argparse.)"""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    group = parser.add_argument_group("steadfast (NVRx ft_launcher's flags)")

    def spellings(*names: str) -> list[str]:
        out: list[str] = []
        for name in names:
            for spelled in (name, "--" + name[2:].replace("-", "_")):
                if spelled not in out:
                    out.append(spelled)
        return out

    group.add_argument(
        *spellings("--ft-cfg-path", "--fault-tol-cfg-path"),
        dest="ft_cfg_path",
        metavar="FILE",
        help="FT config: a YAML file with a fault_tolerance: section (at any depth)",
    )
    for f in fields(FaultToleranceConfig):
        dashed = f.name.replace("_", "-")
        group.add_argument(
            *spellings(f"--ft-{dashed}"),
            f"--ft-param-{f.name}",
            f"--ft-param-{dashed}",
            dest=f"ft_{f.name}",
            metavar="VALUE",
            help=f"FT config field {f.name} (null: infinite)"
            if "timeout" in f.name
            else f"FT config field {f.name}",
        )
    group.add_argument(
        *spellings("--term-timeout"),
        dest="term_timeout",
        type=float,
        metavar="S",
        help="SIGTERM to SIGKILL when the launcher passes a signal to its workers "
        "(default: workers_stop_timeout)",
    )
    group.add_argument(
        *spellings("--workers-stop-timeout"),
        dest="workers_stop_timeout",
        type=float,
        metavar="S",
        help="SIGTERM to SIGKILL when the workers are stopped for a restart",
    )
    group.add_argument(
        *spellings("--ft-restart-policy", "--restart-policy"),
        dest="ft_restart_policy",
        choices=RESTART_POLICIES,
        default="any-failed",
        help="any-failed: every node's workers restart when any fails (min-healthy: not supported)",
    )
    group.add_argument(
        "--metrics-port",
        dest="metrics_port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on PORT (0: a free port, said in the log and the "
        "file_sd file); the job-wide series from the launcher of node rank 0",
    )
    group.add_argument(
        "--metrics-addr",
        dest="metrics_addr",
        metavar="ADDR",
        help="the address the metrics endpoint listens on (default: all)",
    )
    group.add_argument(
        "--metrics-sd-dir",
        dest="metrics_sd_dir",
        metavar="DIR",
        help="write a Prometheus file_sd target file for the endpoint in DIR",
    )
    group.add_argument(
        "--ignore-missing-fault-tol-cfg",
        dest="ft_ignore_missing_cfg",
        action="store_true",
        help="accepted; steadfast needs no FT config (the defaults apply)",
    )
    group.add_argument(
        "--events",
        metavar="PATH",
        help="the run's event log, exported to every worker as $STEADFAST_EVENTS "
        "(default: an inherited $STEADFAST_EVENTS, else ./steadfast_events.jsonl)",
    )
    group.add_argument(
        *spellings("--run-dir"), dest="run_dir", metavar="DIR", help="--events DIR/events.jsonl"
    )
    return parser
