"""Nodes on one machine for the tests in this folder (``scripts/nodes-localhost.sh``).

Each node is its own network, UTS, PID and mount namespace on a private bridge: its own
IP and host name, a power loss that kills all of its processes at once, a link that can
go down (a partition) and come back. The tests run the real launcher on several nodes,
kill or cut them for real and look at what the launchers did.

Without root or network namespaces the tests are skipped with the reason, except in CI
(``CI=true``), where that is a failure: `make test` installs what the script needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "nodes-localhost.sh"
TRAIN = REPO / "tests" / "e2e" / "ft_train.py"
LAUNCH = [sys.executable, "-m", "steadfast.cli", "launch"]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _script(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def _bed_interfaces(prefix: str) -> list[str]:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in (links + spaces).splitlines() if prefix in line]


class Launch:
    """One launcher started on one node; its output goes to ``log``."""

    def __init__(self, node: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.node, self.proc, self.log = node, proc, log
        self.started = 0.0
        self.ended: float | None = None  # when wait() saw it exit

    def poll(self) -> int | None:
        """The exit status once it ended (noting when it was first seen ended), else None."""
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.time()
        return code

    def wait(self, timeout: float = 120) -> int:
        """The launcher's exit status (a node killed under it: the signal's 128 + n)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher on {self.node} did not end in {timeout} s:\n{self.tail()}")
        if self.ended is None:
            self.ended = time.time()
        return code

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Bed:
    """A bed of ``n`` nodes under ``root``; ``shared`` stands for the shared file system."""

    def __init__(self, root: Path, n: int) -> None:
        self.root, self.n = root, n
        self.shared = root / "shared"
        self.events_path = self.shared / "events.jsonl"
        self.launches: list[Launch] = []
        self.prefix = ""

    def up(self) -> None:
        made = _script("up", str(self.root), str(self.n))
        if made.returncode != 0:
            _script("down", str(self.root))
            pytest.fail(f"the bed did not come up: {made.stderr}")
        env = (self.root / "bed.env").read_text()
        self.prefix = next(
            v for k, _, v in (ln.partition("=") for ln in env.split()) if k == "PREFIX"
        )

    def do(self, *args: str) -> None:
        """Run one of the script's node commands (kill, boot, partition, heal, etcd)."""
        done = _script(args[0], str(self.root), *args[1:])
        assert done.returncode == 0, f"nodes-localhost.sh {' '.join(args)}: {done.stderr}"

    def launch(
        self,
        node: str,
        *args: str,
        script: list[str] | None = None,
        program: Path = TRAIN,
        own_log: bool = False,
        cwd: Path = REPO,
    ) -> Launch:
        """Start ``steadfast launch ARGS PROGRAM SCRIPT`` on ``node`` (ft_train.py by
        default). ``own_log``: the node writes an event log of its own
        (``shared/events-<node>.jsonl``, as on a cluster without a shared log), not the
        one every node shares; :meth:`events` reads them all. ``cwd``: the launcher's
        working folder (a script that saves to a relative path: ``shared``)."""
        log = self.root / f"{node}-{len(self.launches)}.log"
        path = self.shared / f"events-{node}.jsonl" if own_log else self.events_path
        cmd = [*LAUNCH, "--events", str(path), *args, str(program), *(script or [])]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", str(SCRIPT), "run", str(self.root), node, *cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
            )
        launch = Launch(node, proc, log)
        launch.started = time.time()
        self.launches.append(launch)
        return launch

    def events(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """The events every launcher and rank wrote so far (of ``kind``, with ``match``)."""
        lines = []
        for path in sorted(self.shared.glob("events*.jsonl")):
            try:
                lines += path.read_text().splitlines()
            except FileNotFoundError:
                continue
        found = []
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:  # a line another node is writing this instant
                continue
            if (kind is None or e["kind"] == kind) and all(e.get(k) == v for k, v in match.items()):
                found.append(e)
        return found

    def wait_event(self, kind: str, timeout: float = 60, **match: Any) -> dict[str, Any]:
        """The first ``kind`` event with ``match``, waiting for it."""
        end = time.monotonic() + timeout
        while not (found := self.events(kind, **match)):
            if time.monotonic() > end:
                pytest.fail(f"no {kind} event {match or ''} in {timeout} s:\n{self.logs()}")
            time.sleep(0.1)
        return found[0]

    def wait_all(self, launches: list[Launch], timeout: float = 180) -> dict[str, int]:
        """Each of ``launches``' exit status, once all ended (the test fails past
        ``timeout`` seconds, naming the nodes still running)."""
        end = time.monotonic() + timeout
        while any(lc.poll() is None for lc in launches):
            if time.monotonic() > end:
                left = [lc.node for lc in launches if lc.proc.poll() is None]
                pytest.fail(f"launchers on {left} did not end in {timeout} s:\n{self.logs()}")
            time.sleep(0.05)
        return {lc.node: lc.proc.returncode for lc in launches}

    def logs(self) -> str:
        return "\n".join(f"--- {lc.node} ({lc.log.name})\n{lc.tail()}" for lc in self.launches)

    def down(self) -> None:
        for lc in self.launches:
            if lc.proc.poll() is None:
                lc.proc.kill()
        _script("down", str(self.root))
        for lc in self.launches:  # the node's processes went with its PID namespace
            lc.proc.wait(30)


@pytest.fixture
def etcd_installed() -> None:
    """etcd (Debian's etcd-server) for the members and python-etcd for torch's backend."""
    import importlib.util
    import shutil

    if shutil.which("etcd") is None or importlib.util.find_spec("etcd") is None:
        reason = "etcd or python-etcd is not installed (`make test` installs both)"
        if IN_CI:
            pytest.fail(f"{reason}; CI must run the etcd tests")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def can_make_nodes() -> None:
    checked = _script("check")
    if checked.returncode != 0:
        reason = f"cannot make nodes on this machine: {checked.stderr.strip()}"
        if IN_CI:
            pytest.fail(f"{reason}; CI must run the multi-node tests")
        pytest.skip(reason)


@pytest.fixture
def bed_factory(can_make_nodes: None, tmp_path: Path) -> Iterator[Any]:
    """``bed_factory(n)`` makes a bed of n nodes; every bed is taken down after the test,
    and nothing of it (namespace, interface, process) may outlive it."""
    beds: list[Bed] = []

    def make(n: int) -> Bed:
        bed = Bed(tmp_path / f"bed{len(beds)}", n)
        beds.append(bed)
        bed.up()
        bed.shared.mkdir(exist_ok=True)
        return bed

    yield make
    for bed in beds:
        bed.down()
    for bed in beds:
        left = _bed_interfaces(bed.prefix) if bed.prefix else []
        assert not left, f"the bed left namespaces or interfaces behind: {left}"
        pids = subprocess.run(
            ["pgrep", "-f", str(bed.root)], capture_output=True, text=True
        ).stdout.split()
        assert not pids, f"the bed left processes behind: {pids}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``reference(steps, world=4, *flags)``: the model a fault-free run of ft_train.py on
    ``world`` ranks (one node) ends with on this host (one run each), for the bit-for-bit
    comparisons; ``flags``: ft_train's own (``--fsdp``)."""
    made: dict[tuple[Any, ...], dict[str, Any]] = {}

    def get(steps: int, world: int = 4, *flags: str) -> dict[str, Any]:
        key = (steps, world, *flags)
        if key not in made:
            import torch

            root = tmp_path_factory.mktemp(f"reference{steps}")
            done = subprocess.run(
                [
                    *LAUNCH,
                    "--nproc-per-node",
                    str(world),
                    "--events",
                    str(root / "events.jsonl"),
                    str(TRAIN),
                    "--ckpt",
                    str(root / "ck"),
                    "--out",
                    str(root / "out.pt"),
                    "--steps",
                    str(steps),
                    *flags,
                ],
                capture_output=True,
                text=True,
                timeout=180,
                cwd=REPO,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            made[key] = torch.load(root / "out.pt")
        return made[key]

    return get
