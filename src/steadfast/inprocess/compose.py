"""``Compose``: function composition of the Wrapper's hooks (NVRx ``inprocess.Compose``).

``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the hooks run right to left, each one given
what the one before returned (a tuple is unpacked into several arguments; hooks of no
arguments compose too). Every hook of steadfast returns the state it was given (or a
new one, for rank assignments), so hooks of any kind compose, as in NVRx's docs:
``abort=Compose(AbortTransformerEngine(), AbortTorchDistributed())``. A hook that gets
arguments and returns ``None`` breaks the chain: the next hook gets ``None``, with a
``UserWarning`` naming the hook, as in NVRx. The composed object is an instance of the
most derived class that all its hooks share, so a ``Compose`` of aborts is an
:class:`~steadfast.inprocess.Abort` and is accepted where one is.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["Compose"]


def _takes_arguments(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` takes any argument (a hook of none is called with none)."""
    try:
        return bool(inspect.signature(hook).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return True


def _common_base(hooks: tuple[Callable[..., Any], ...]) -> type:
    """The most derived class in the first hook's MRO that every hook is an instance of."""
    for cls in type(hooks[0]).__mro__:
        if all(isinstance(h, cls) for h in hooks[1:]):
            return cls
    return object  # pragma: no cover - object is in every MRO


_KINDS: dict[tuple[type, type], type] = {}


def _kind(cls: type, base: type) -> type:
    """``cls``, made an instance of ``base`` too (an Abort, an Initialize, ...) when that
    is a class of hooks; plain ``cls`` for functions and other built-in kinds."""
    if base is object or issubclass(cls, base):
        return cls
    kind = _KINDS.get((cls, base))
    if kind is None:
        try:
            kind = type(f"Compose[{base.__name__}]", (cls, base), {})
        except TypeError:  # not a class one can derive from (a function, a builtin)
            kind = cls
        _KINDS[cls, base] = kind
    return kind


class Compose:
    """``Compose(a, b, c)(x) == a(b(c(x)))`` (see the module docstring)."""

    hooks: tuple[Callable[..., Any], ...]

    def __new__(cls, *hooks: Callable[..., Any]) -> Compose:
        if not hooks:
            raise ValueError("Compose needs at least one hook")
        for hook in hooks:
            if not callable(hook):
                raise TypeError(f"Compose: {hook!r} is not callable")
        kind = _kind(cls, _common_base(hooks))
        self: Compose = object.__new__(kind)
        self.hooks = hooks
        return self

    def __init__(self, *hooks: Callable[..., Any]) -> None:
        pass  # __new__ did it; the hooks' own __init__ must not run again

    def __call__(self, *args: Any) -> Any:
        result = None
        for hook in reversed(self.hooks):
            result = hook(*args)
            if result is None and args and args != (None,):
                warnings.warn(
                    f"Compose: {type(hook).__name__} returned None: it did not pass on "
                    f"its arguments {args!r}",
                    UserWarning,
                    stacklevel=2,
                )
            if isinstance(result, tuple):
                args = result  # a tuple is the next hook's arguments
            elif result is None and not _takes_arguments(hook):
                args = ()
            else:
                args = (result,)
        return result

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(h) for h in self.hooks)})"
