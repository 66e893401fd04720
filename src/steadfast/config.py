"""Configuration errors and validation helpers shared by every steadfast component.

Bad input (a config field, a flag, a state file) must produce one readable error that
names the field, never a traceback from deep inside and never a silent default. Every
validation in steadfast raises :class:`ConfigError` through the helpers here.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

__all__ = ["ConfigError", "require_choice", "require_number"]


class ConfigError(ValueError):
    """A configuration value, flag, or state file is invalid; the message names it.

    Subclasses ``ValueError`` so callers that caught the original libraries' ValueError
    keep working.
    """


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
