"""A real single-node Slurm cluster for the tests in this folder.

``scripts/slurm-localhost.sh start`` runs munged, slurmctld and slurmd with a
configuration, state and logs of their own in a temporary folder; every test talks to
it through ``SLURM_CONF``. Without Slurm installed the tests are skipped with the reason,
except in CI (``CI=true``), where a missing cluster is a failure: `make test` installs
the packages first (the script's ``install``) when the machine allows it.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurmcluster import CLUSTER_SCRIPT, Cluster

from sfharness import assert_none_left


def _script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env
    )


def _free_ports(n: int) -> list[int]:
    """Ports free now, for a cluster that must not meet another one on this machine."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """munged + slurmctld + slurmd for the whole session, stopped by pid at its end."""
    if _script("check").returncode != 0:
        reason = (
            "Slurm is not installed (Debian's slurm-wlm and munge; "
            "`scripts/slurm-localhost.sh install` needs root and apt-get, and `make test` "
            "runs it when it can)"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}: CI must run the Slurm tests")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    ctld, slurmd = _free_ports(2)
    ports = dict(os.environ, SF_SLURMCTLD_PORT=str(ctld), SF_SLURMD_PORT=str(slurmd))
    started = _script("start", str(root), env=ports)
    if started.returncode != 0:
        _script("stop", str(root))
        pytest.fail(f"the test cluster did not start: {started.stderr}")
    env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
    env.pop("STEADFAST_EVENTS", None)  # a job writes to its run folder's log
    cluster = Cluster(root, env)
    yield cluster
    try:
        left = cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        cluster.jobs.extend(left)
        cluster.cancel_all()
    finally:
        stopped = _script("stop", str(root))
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture
def slurm(slurm_cluster: Cluster, tmp_path: Path) -> Iterator[Cluster]:
    """The cluster, with this test's jobs cancelled and their processes gone after it."""
    yield slurm_cluster
    slurm_cluster.cancel_all()
    assert_none_left(str(tmp_path), timeout=15)
