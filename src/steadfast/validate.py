"""Configuration errors and the validation helpers every steadfast setting uses.

Bad input (a config field, a flag, a state file) must produce one readable error that
names the field, never a traceback from deep inside and never a silent default. Every
validation in steadfast raises :class:`ConfigError` through the helpers here
(re-exported by :mod:`steadfast.config`).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Collection
from typing import Any

__all__ = [
    "ConfigError",
    "parse_signal",
    "require_bool",
    "require_choice",
    "require_number",
    "require_timeout",
]


class ConfigError(ValueError):
    """A configuration value, flag, or state file is invalid; the message names it.

    Subclasses ``ValueError`` so callers that caught the original libraries' ValueError
    keep working.
    """

    #: True when a config file was read but has no ``fault_tolerance:`` section (which
    #: NVRx's launcher accepts when flags give the config)
    missing_section: bool = False


class _MissingSection(ConfigError):
    missing_section = True


def require_choice(field: str, value: Any, choices: Collection[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ConfigError naming ``field``."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"{field}: {value!r} is not valid; expected one of {', '.join(map(repr, choices))}"
        )
    return value


def require_number(
    field: str,
    value: Any,
    *,
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    integer: bool = False,
) -> Any:
    """Return ``value`` if it is a number within bounds, else raise a ConfigError naming it.

    Booleans are rejected (``True`` is an int in Python, never a sensible count), and so
    are NaN and infinity (a NaN deadline never passes; a timer cannot wait forever).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
    ):
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{field}: expected {what}, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{field}: must be a finite number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ConfigError(f"{field}: must be >= {minimum}, got {value!r}")
    if exclusive_minimum is not None and number <= exclusive_minimum:
        raise ConfigError(f"{field}: must be > {exclusive_minimum}, got {value!r}")
    return value


def require_timeout(field: str, value: Any) -> float | None:
    """A timeout in seconds; None (YAML ``null``) means infinite."""
    if value is None:
        return None
    return float(require_number(field, value, exclusive_minimum=0))


def parse_signal(value: Any, field: str = "signal") -> signal.Signals:
    """The signal ``value`` names: a name with or without ``SIG`` in any case
    (``"SIGUSR1"``, ``"usr1"``), a number (``10``, ``"10"``) or a :class:`signal.Signals`;
    anything else raises a ConfigError naming ``field``. The one parser of signals that
    configs, flags and the batch script name."""
    if isinstance(value, signal.Signals):
        return value
    text = value.strip() if isinstance(value, str) else None
    if text is not None and text.isascii() and text.isdigit():
        number: Any = int(text)
    else:
        number = value
    if isinstance(number, int) and not isinstance(number, bool):
        try:
            return signal.Signals(number)
        except ValueError:
            pass
    elif text is not None:
        name = text.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in signal.Signals.__members__:
            return signal.Signals[name]
    raise ConfigError(f"{field}: {value!r} is not a signal (e.g. SIGKILL, SIGTERM or 9)")


def require_bool(field: str, value: Any) -> bool:
    """A yes/no field from a bool or its usual spellings."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise ConfigError(f"{field}: expected true or false, got {value!r}")
