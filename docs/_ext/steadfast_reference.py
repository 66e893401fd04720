"""The documentation's generated reference: written from the code at every build, so it
cannot drift from it.

- ``_generated/cli.md``: every ``steadfast`` sub-command from its argument parser
  (:func:`steadfast.cli.build_parser`), ``steadfast launch`` from
  :func:`steadfast.launcher.get_args_parser` (torchrun's own parser plus steadfast's
  flags), and the fault-tolerance config's fields from
  :class:`steadfast.FaultToleranceConfig` (their defaults, and their text from the
  class's ``Attributes:``);
- ``_generated/events.md``: the common fields and every event kind with its fields, from
  :data:`steadfast.events.schema.EVENT_KINDS`;
- ``_generated/exit-codes.md``: the launcher's exit codes, from
  :mod:`steadfast.launcher.exit_codes`.

The reference pages include them (``{include}``); every kind, exit code and sub-command
gets a label (``event-node-lost``, ``exit-75``, ``cli-launch``) for ``{ref}`` links.
sphinx-argparse was considered for the CLI: it renders each of the launcher's five
spellings of every config field as its own option (some 300 lines for 60 fields) and
gives no labels of our choosing; what is needed here is a list per parser.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

_ESCAPE = re.compile(r"([*<>\[\]\\])")


def _text(s: str) -> str:
    """Plain text for Markdown: the characters that would start markup escaped, code
    spans (backticks) left as they are."""
    parts = s.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = _ESCAPE.sub(r"\\\1", parts[i])
    return "`".join(parts)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    with contextlib.suppress(KeyError, TypeError, ValueError):  # a help with a stray %
        text = text % {**vars(action), "prog": prog}
    default = action.default
    shown = default not in (None, False, argparse.SUPPRESS, [], "") and "default" not in text
    if shown and not isinstance(action, argparse._StoreConstAction):
        text = f"{text} (default: `{default}`)" if text else f"default: `{default}`"
    return " ".join(text.split())


def _spelling(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        many = action.nargs in ("*", "...", argparse.REMAINDER)
        return f"`{name} ...`" if many else f"`{name}`"
    takes = action.nargs != 0
    metavar = action.metavar or action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.choices is not None and action.metavar is None:
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    # NVRx's underscore spellings (--ft_cfg_path) of a dashed flag: said once, on the page
    dashed = set(action.option_strings)
    spelled = [
        o for o in action.option_strings if not (o[2:].count("_") and o.replace("_", "-") in dashed)
    ]
    names = ", ".join(f"`{o} {metavar}`" if takes else f"`{o}`" for o in spelled if o != "-h")
    return names or "`-h`"


def _actions(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    out: list[str] = []
    for action in actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help is argparse.SUPPRESS:
            continue
        out += [_spelling(action), f": {_text(_help(action, parser.prog)) or '(no help text)'}", ""]
    return out


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, help) of each sub-command, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return []


def _config_fields() -> list[tuple[str, str, str]]:
    """(name, default, text) of every fault-tolerance config field, the text from the
    ``Attributes:`` sections of the config class and its bases."""
    from steadfast import FaultToleranceConfig

    texts: dict[str, str] = {}
    for cls in FaultToleranceConfig.__mro__:
        doc = inspect.getdoc(cls) or ""
        if "Attributes:" not in doc:
            continue
        name = None
        for line in doc.split("Attributes:", 1)[1].splitlines():
            m = re.match(r"^    (\w+): ?(.*)$", line)
            if m:
                name = m.group(1)
                texts.setdefault(name, m.group(2))
            elif line.startswith("        ") and name is not None:
                texts[name] = texts[name] + " " + line.strip()
            elif line.strip() and not line.startswith(" "):
                break
    out = []
    for f in dataclasses.fields(FaultToleranceConfig):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        out.append((f.name, default, " ".join(texts.get(f.name, "").split())))
    return out


def cli_markdown() -> str:
    from steadfast.cli import build_parser
    from steadfast.launcher import get_args_parser

    lines = [
        "<!-- generated by docs/_ext/steadfast_reference.py from the argument parsers -->",
        "",
    ]
    for name, sub, help_text in _subcommands(build_parser()):
        lines += [f"(cli-{name})=", f"## `steadfast {name}`", "", _text(help_text), ""]
        if name == "launch":
            lines += _launch_markdown(get_args_parser())
            continue
        if sub.description:
            lines += [_text(sub.description), ""]
        usage = [u.removeprefix("usage: ") for u in sub.format_usage().rstrip().splitlines()]
        usage[1:] = [u[len("usage: ") :] for u in usage[1:]]  # aligned under the command
        lines += ["```{code-block} text", ":class: usage", "", *usage, "```", ""]
        lines += _actions(sub, sub._actions)
    lines += _config_markdown()
    return "\n".join(lines).rstrip() + "\n"


def _launch_markdown(parser: argparse.ArgumentParser) -> list[str]:
    ft_fields = {f"ft_{name}" for name, _, _ in _config_fields()}
    ours, torchruns = [], []
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.dest in ft_fields:
                continue  # one entry per field, below: every spelling is the same flag
            (ours if group.title and group.title.startswith("steadfast") else torchruns).append(
                action
            )
    lines = [
        "```{code-block} text",
        ":class: usage",
        "",
        "steadfast launch [TORCHRUN FLAGS] [STEADFAST FLAGS] SCRIPT [SCRIPT ARGS]",
        "```",
        "",
        "Also installed as `ft_launcher`. Nothing after the script is read by the launcher;"
        " every flag with dashes also takes underscores (`--ft_cfg_path`), as NVRx's does.",
        "",
        "### steadfast's flags",
        "",
    ]
    lines += _actions(parser, ours)
    lines += [
        "`--ft-FIELD VALUE`, `--ft-param-FIELD=VALUE`",
        ": any [fault-tolerance config field](#fault-tolerance-config-fields), dashes or"
        " underscores (`--ft-node-lost-timeout 120`, `--ft-param-node_lost_timeout=120`);"
        " `null` is an infinite timeout. Given on the command line it overrides"
        " `--ft-cfg-path`.",
        "",
        "### torchrun's flags",
        "",
        "The installed torch's own parser (`torch.distributed.run`): every torchrun flag"
        " works as it does there.",
        "",
    ]
    lines += _actions(parser, torchruns)
    return lines


def _config_markdown() -> list[str]:
    lines = [
        "(cli-ft-config)=",
        "## Fault-tolerance config fields",
        "",
        "From `--ft-cfg-path FILE.yaml` (a `fault_tolerance:` section at any depth), then"
        " `--ft-FIELD` flags; in code, {py:class}`steadfast.FaultToleranceConfig`.",
        "",
    ]
    for name, default, text in _config_fields():
        lines += [f"`{name}` (default `{default}`)", f": {_text(text) or '(no text)'}", ""]
    return lines


def events_markdown() -> str:
    from steadfast.events.schema import COMMON_FIELDS, EVENT_KINDS, SLURM_FIELDS

    lines = [
        "<!-- generated by docs/_ext/steadfast_reference.py from steadfast.events.schema -->",
        "",
        "## Fields of every event",
        "",
        "Every line of the event log is one JSON object with "
        + ", ".join(f"`{f}`" for f in COMMON_FIELDS)
        + "; under Slurm also "
        + ", ".join(f"`{f}`" for f in SLURM_FIELDS)
        + ". The fields below are each kind's own.",
        "",
        "## Event kinds",
        "",
    ]
    for kind in EVENT_KINDS.values():
        label = "event-" + kind.name.replace("_", "-")
        lines += [f"({label})=", f"### `{kind.name}`", "", _text(kind.description), ""]
        for fname, ftext in kind.fields.items():
            lines.append(f"- `{fname}`: {_text(ftext)}")
        if kind.fields:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def exit_codes_markdown() -> str:
    from steadfast.launcher import exit_codes

    lines = [
        "<!-- generated by docs/_ext/steadfast_reference.py from steadfast.launcher.exit_codes -->",
        "",
    ]
    for code, reason in sorted(exit_codes.EXIT_REASONS.items()):
        lines += [f"(exit-{code})=", f"## {code}: {_text(reason)}", ""]
    return "\n".join(lines).rstrip() + "\n"


#: The public modules, in the order the API page shows them. A name a module shares with
#: ``steadfast`` itself is documented once, under ``steadfast``.
API_MODULES = (
    ("steadfast", "The library's front: the names of KempnerForge, NVRx and Megatron Bridge."),
    ("steadfast.checkpoint", "Atomic, verified checkpoints and the memory tier."),
    ("steadfast.monitor", "Heartbeats, sections and their timeouts (NVRx's rank monitor)."),
    ("steadfast.straggler", "Straggler detection (NVRx and Megatron Bridge)."),
    ("steadfast.inprocess", "In-process restart (NVRx's `inprocess`)."),
    ("steadfast.rerun", "The re-run state machine: result attribution (Megatron)."),
    ("steadfast.events", "The event log: writing and reading it."),
    ("steadfast.dist", "Small distributed helpers."),
    ("steadfast.riders", "Flags carried by an all-reduce another component makes anyway."),
    ("steadfast.faults", "Planned faults, to rehearse recovery."),
    ("steadfast.signals", "Signals: cooperative shutdown and preemption."),
    ("steadfast.slurm", "The job's Slurm environment."),
    ("steadfast.secret", "The job secret that seals the control plane's records."),
    ("steadfast.launcher", "The launcher, as a library."),
    ("steadfast.integrations.lightning", "PyTorch Lightning callbacks and checkpoint plugin."),
    ("steadfast.integrations.transformers", "Hugging Face Trainer callbacks."),
)


def api_markdown() -> str:
    import importlib

    lines = [
        "<!-- generated by docs/_ext/steadfast_reference.py from each module's __all__ -->",
        "",
    ]
    documented: set[int] = set()
    for name, summary in API_MODULES:
        module = importlib.import_module(name)
        members = []
        for member in getattr(module, "__all__", []):
            if member.startswith("_"):
                continue
            obj = getattr(module, member)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants and submodules: named in the guides
            if id(obj) in documented:
                continue
            documented.add(id(obj))
            members.append((member, "autoclass" if inspect.isclass(obj) else "autofunction"))
        lines += [f"## `{name}`", "", summary, ""]
        lines += ["```{eval-rst}", f".. automodule:: {name}", "   :no-members:", "```", ""]
        for member, directive in members:
            lines += ["```{eval-rst}", f".. {directive}:: {name}.{member}", "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _write(path: Path, text: str) -> None:
    """Write only what changed, so that Sphinx rebuilds only the pages that include it."""
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def generate(app: Sphinx) -> None:
    out = Path(app.srcdir) / "_generated"
    _write(out / "cli.md", cli_markdown())
    _write(out / "events.md", events_markdown())
    _write(out / "exit-codes.md", exit_codes_markdown())
    _write(out / "api.md", api_markdown())


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
