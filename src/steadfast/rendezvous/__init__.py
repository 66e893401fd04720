"""steadfast's own rendezvous (``--rdzv-backend steadfast``): O(1) store operations and
bytes per node (``handler.py`` says how; ``keys.py`` owns the key layout).

:func:`register` adds it to torch's rendezvous registry (``steadfast launch`` does, before
its agent starts); plain ``torchrun`` finds it through the ``torchrun.handlers`` entry
point (:func:`torchrun_handler`). Importing this package does not import torch."""

from __future__ import annotations

import contextlib
from typing import Any

from .keys import BACKEND

__all__ = ["BACKEND", "register", "torchrun_handler"]


def create_handler(params: Any) -> Any:
    """The creator torch's registry calls for ``--rdzv-backend steadfast``
    (:func:`.create.create_handler`, imported when called: torch's registry loads its
    plugins while ``torch.distributed.elastic.rendezvous`` is first imported, which
    :mod:`.handler` itself does, so importing it from here at registration would import
    it half-made, and torch would warn of a circular import)."""
    from .create import create_handler as create

    return create(params)


def torchrun_handler() -> Any:
    """The ``torchrun.handlers`` entry point's object: :func:`create_handler`."""
    return create_handler


def register() -> None:
    """Make ``--rdzv-backend steadfast`` known to torch's rendezvous registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    # registered already: the entry point's creator, or ours
    with contextlib.suppress(ValueError):
        rendezvous_handler_registry.register(BACKEND, create_handler)
