"""The agent's side of the rendezvous (the :mod:`steadfast.rendezvous` package is a
backend): the handler ``--rdzv-backend`` named (steadfast's own, or torch's), made to
outlast a node that leaves and a backend that does not answer for a moment; and the
three things the agent asks of any of them (this node's id, expiring lost nodes, a
shorter join after a loss), each answered by steadfast's handler itself or by the seam
for torch's dynamic one."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
)

from .. import seam
from ..rendezvous.handler import SteadfastRendezvousHandler

__all__ = ["Rendezvous"]

logger = logging.getLogger(__name__)


class Rendezvous(RendezvousHandler):
    """torch's rendezvous handler, except that a node that leaves the job (unhealthy,
    or cut off) does not close the rendezvous for the others on its way out (torch's
    ``launch_agent`` shuts it down on any error but a signal), and that a backend that
    does not answer for a moment (an etcd cluster electing a new leader after losing
    one, a store host's brief stall) does not end the launcher, and with it the job:
    a join is tried again for up to ``retry_window`` seconds, and a failed count of the
    waiting nodes counts none this time."""

    def __init__(self, wrapped: RendezvousHandler, retry_window: float = 60.0) -> None:
        self.wrapped = wrapped
        self.leaving = False
        self.retry_window = retry_window

    def get_backend(self) -> str:
        return self.wrapped.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return bool(self.wrapped.use_agent_store)

    def next_rendezvous(self) -> Any:
        deadline = time.monotonic() + self.retry_window
        pause = 0.2
        while True:
            try:
                return self.wrapped.next_rendezvous()
            except RendezvousConnectionError as exc:
                if time.monotonic() + pause > deadline:
                    raise
                logger.warning("the rendezvous backend did not answer (%s); joining again", exc)
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def is_closed(self) -> bool:
        return self.wrapped.is_closed()

    def set_closed(self) -> None:
        self.wrapped.set_closed()  # type: ignore[no-untyped-call]

    def num_nodes_waiting(self) -> int:
        try:
            return self.wrapped.num_nodes_waiting()
        except RendezvousConnectionError as exc:  # asked again at the next check
            logger.warning("could not count the nodes waiting to join: %s", exc)
            return 0

    def get_run_id(self) -> str:
        return self.wrapped.get_run_id()

    def shutdown(self) -> bool:
        if self.leaving:
            return True
        return self.wrapped.shutdown()

    def node_id(self) -> list[Any] | None:
        """This node in the rendezvous, JSON-able (None for static and legacy etcd)."""
        if isinstance(self.wrapped, SteadfastRendezvousHandler):
            return self.wrapped.node_id()
        return seam.rendezvous_node_id(self.wrapped)

    def expire(self, node_ids: list[list[Any]]) -> int:
        """The lost nodes ``node_ids`` (from :meth:`node_id`) are taken out of the
        rendezvous now, not when their keep-alive runs out (a spare takes their place,
        the next round does not wait for them)."""
        if isinstance(self.wrapped, SteadfastRendezvousHandler):
            return self.wrapped.expire(node_ids)
        return seam.expire_rendezvous_nodes(self.wrapped, node_ids)

    @contextlib.contextmanager
    def join_timeout(self, seconds: float) -> Iterator[None]:
        """Within the block a join gives up after ``seconds`` (``RendezvousTimeoutError``)."""
        if isinstance(self.wrapped, SteadfastRendezvousHandler):
            with self.wrapped.join_timeout_of(seconds):
                yield
            return
        with seam.rendezvous_join_timeout(self.wrapped, seconds):
            yield

    def __getattr__(self, name: str) -> Any:  # settings and the like
        return getattr(self.wrapped, name)
