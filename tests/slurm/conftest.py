"""Real Slurm clusters for the tests in this folder.

``slurm_cluster``: ``scripts/slurm-localhost.sh start`` runs munged, slurmctld and slurmd
on this machine, with a configuration, state and logs of their own in a temporary
folder; every test talks to it through ``SLURM_CONF``.

``slurm_nodes``: a cluster of several nodes on a bed of network namespaces
(``scripts/nodes-localhost.sh``): slurmctld on node1, a slurmd on each of node2..node5,
each with its own host name, address and processes, so a node can be killed for real.

Without Slurm (or without what a bed needs) the tests are skipped with the reason, except
in CI (``CI=true``), where a missing cluster is a failure: `make test` installs the
packages first (the scripts' ``install``) when the machine allows it.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurmcluster import CLUSTER_SCRIPT, NODES_SCRIPT, BedCluster, Cluster

from sfharness import assert_none_left


def _script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env
    )


NOT_INSTALLED = (
    "Slurm is not installed (Debian's slurm-wlm and munge; "
    "`scripts/slurm-localhost.sh install` needs root and apt-get, and `make test` "
    "runs it when it can)"
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


IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_or_fail(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason}: CI must run the Slurm tests")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """munged + slurmctld + slurmd for the whole session, stopped by pid at its end."""
    if _script("check").returncode != 0:
        _skip_or_fail(NOT_INSTALLED)
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


#: compute nodes of the bed's cluster (node1 is the controller's machine)
BED_NODES = 5


@pytest.fixture(scope="session")
def slurm_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BedCluster]:
    """A Slurm cluster across a bed of nodes, for the whole session: slurmctld on node1,
    slurmd on node2..node5. Stopped, and the bed taken down, at the end; nothing of
    either may be left (a daemon, a namespace, an interface)."""
    if _script("check").returncode != 0:
        _skip_or_fail(NOT_INSTALLED)
    nodes = subprocess.run(
        ["bash", str(NODES_SCRIPT), "check"], capture_output=True, text=True, timeout=60
    )
    if nodes.returncode != 0:
        _skip_or_fail(f"cannot make nodes on this machine: {nodes.stderr.strip()}")
    root = tmp_path_factory.mktemp("slurmbed")
    bed, slurm_dir = root / "bed", root / "slurm"

    def bed_script(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(NODES_SCRIPT), *args], capture_output=True, text=True, timeout=120
        )

    made = bed_script("up", str(bed), str(BED_NODES), "10.214.0")
    if made.returncode != 0:
        bed_script("down", str(bed))
        pytest.fail(f"the bed did not come up: {made.stderr}")
    prefix = dict(ln.split("=", 1) for ln in (bed / "bed.env").read_text().split())["PREFIX"]
    try:
        started = _script("start-bed", str(slurm_dir), str(bed))
        if started.returncode != 0:
            pytest.fail(f"the cluster did not start on the bed: {started.stderr}")
        env = dict(os.environ, SLURM_CONF=str(slurm_dir / "slurm.conf"))
        env.pop("STEADFAST_EVENTS", None)
        cluster = BedCluster(
            slurm_dir,
            env,
            client=["bash", str(CLUSTER_SCRIPT), "client", str(slurm_dir)],
            bed=bed,
            compute=[f"node{i}" for i in range(2, BED_NODES + 1)],
        )
        yield cluster
        left = cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        cluster.jobs.extend(left)
        cluster.cancel_all()
    finally:
        stopped = _script("stop", str(slurm_dir))
        downed = bed_script("down", str(bed))
    assert stopped.returncode == 0, stopped.stderr
    assert downed.returncode == 0, downed.stderr
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    listed += subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed, f"the bed left namespaces or interfaces: {listed}"
    daemons = subprocess.run(
        ["pgrep", "-f", str(root)], capture_output=True, text=True
    ).stdout.split()
    assert not daemons, f"the cluster or bed left processes behind: {daemons}"


@pytest.fixture
def slurm_bed(slurm_nodes: BedCluster, tmp_path: Path) -> Iterator[BedCluster]:
    """The bed's cluster with every node up and idle; this test's jobs cancelled and
    their processes gone after it, and the nodes it killed brought back."""
    slurm_nodes.revive()
    yield slurm_nodes
    slurm_nodes.cancel_all()
    assert_none_left(str(tmp_path), timeout=15)
