"""The Wrapper with hooks and stores as NVRx's users pass them (2 real processes):
a composed initialize that raises ends at the retry limit instead of restarting forever;
an exception of ``store_factory`` reaches the caller unchanged; ``store_kwargs`` with a
port and no ``MASTER_PORT`` in the environment is accepted."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

from sfharness import Ranks
from steadfast.inprocess import (
    CallWrapper,
    Compose,
    Initialize,
    RestartAbort,
    RetryController,
    TCPStore,
    Wrapper,
)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RaisingInit(Initialize):
    """An initialize hook that fails in every iteration (a broken set-up step)."""

    def __call__(self, state: Any) -> Any:
        raise ValueError(f"initialize failed in iteration {state.iteration}")


class BrokenStore(TCPStore):
    """A store factory that cannot make its store."""

    def __init__(self, **kwargs: Any) -> None:
        raise ConnectionRefusedError(f"no store at port {kwargs.get('port')}")


def _wrapped(case: str) -> Wrapper:
    common: dict[str, Any] = dict(
        soft_timeout=_td(20),
        hard_timeout=_td(30),
        barrier_timeout=_td(60),
        monitor_thread_interval=_td(0.1),
        monitor_process_interval=_td(0.1),
        last_call_wait=_td(0.2),
    )
    if case == "compose":
        return Wrapper(
            initialize=Compose(RaisingInit(), RetryController(max_iterations=2)), **common
        )
    if case == "store_factory":
        return Wrapper(store_factory=BrokenStore, **common)
    return Wrapper(store_kwargs={"port": int(os.environ["SF_STORE_PORT"])}, **common)


def hooked(rank: int, world: int, workdir: Path, case: str) -> dict[str, Any]:
    seen: list[int] = []

    def train(call_wrapper: CallWrapper | None = None) -> str:
        assert call_wrapper is not None
        seen.append(call_wrapper.iteration)
        return "done"

    try:
        result: Any = _wrapped(case)(train)()
    except BaseException as exc:  # what reached the caller, unchanged
        result = (type(exc).__name__, str(exc))
    return {"result": result, "seen": seen}


def _run(tmp_path: Path, case: str, env: dict[str, str]) -> list[dict[str, Any]]:
    ranks = Ranks(hooked, tmp_path, 2, (case,), {"SFHARNESS_NO_INIT": "1", **env})
    ranks.wait(120)
    return ranks.results()


def _master(port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_a_composed_initialize_that_raises_stops_at_the_retry_limit(tmp_path: Path) -> None:
    out = _run(tmp_path, "compose", _master(_free_port() - 1))
    for res in out:
        assert res["seen"] == []  # the function never ran: initialize failed first
        name, message = res["result"]
        assert name == RestartAbort.__name__
        assert "retry limit reached: iteration=2 max_iterations=2" in message


def test_a_store_factory_error_reaches_the_caller_unchanged(tmp_path: Path) -> None:
    port = _free_port()
    for res in _run(tmp_path, "store_factory", _master(port - 1)):
        assert res["result"] == ("ConnectionRefusedError", f"no store at port {port}")


def test_store_kwargs_port_needs_no_master_port(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = {"MASTER_ADDR": "127.0.0.1", "SF_STORE_PORT": str(_free_port())}
    for res in _run(tmp_path, "port", env):
        assert res["result"] == "done" and res["seen"] == [0]
