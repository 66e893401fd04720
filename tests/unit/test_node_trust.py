"""The checks a node passes before it is trusted (steadfast.launcher.nodes.trust), on
real things: folders (one a read-only mount in a mount namespace of its own), a real
link in a network namespace of its own (a veth pair: up, at its speed, then down), and
the wait for a previous worker's GPU memory (NVML where there is a driver; here, the
same wait on a real process's life, and the NVML check skipped with its reason)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from steadfast.config import FaultToleranceConfig
from steadfast.launcher.nodes import GpuCheck, health_check
from steadfast.launcher.nodes.trust import (
    check_mounts,
    check_network,
    gpu_memory_freed,
    job_interface,
)

pytestmark = pytest.mark.timeout(120)
ROOT = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare")


def test_a_folder_the_job_writes_to_takes_a_write_and_fsync(tmp_path: Path) -> None:
    ok = check_mounts([str(tmp_path)], 30.0)
    assert ok.failed is None and ok.figure is not None and ok.figure > 0
    assert not list(tmp_path.iterdir())  # the probe's file removed
    missing = check_mounts([str(tmp_path), str(tmp_path / "scratch")], 30.0)
    assert missing.failed is not None and "scratch is not there" in missing.failed
    # a write that cannot finish within its bound (a child process always takes longer)
    slow = check_mounts([str(tmp_path)], 0.001)
    assert slow.failed is not None and "took more than 0.001 s" in slow.failed


@pytest.mark.skipif(not ROOT, reason="needs root, unshare and ip (network namespaces)")
def test_a_read_only_mount_is_not_trusted(tmp_path: Path) -> None:
    """The check in a mount namespace of its own, where the folder is a read-only tmpfs
    (a file system remounted read-only after an error, as ext4 and Lustre do)."""
    target = tmp_path / "ckpt"
    target.mkdir()
    code = (
        "import json, sys\n"
        "from steadfast.launcher.nodes.trust import check_mounts\n"
        "print(json.dumps(check_mounts([sys.argv[1]], 30.0).__dict__))\n"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o ro tmpfs "$1" && exec "$2" -c "$3" "$1"', "sh",
         str(target), sys.executable, code],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)
    assert check["failed"] is not None and "not writable" in check["failed"], check
    assert "Read-only file system" in check["failed"]


@pytest.fixture
def link():
    """A veth pair: ``inside`` in a network namespace of its own (10.77.0.2/24),
    ``outside`` on this host (10.77.0.1/24), both up. Removed afterwards."""
    if not ROOT:
        pytest.skip("needs root, unshare and ip (network namespaces)")
    tag = uuid.uuid4().hex[:6]
    ns, outside, inside = f"sft-{tag}", f"sfo{tag}", f"sfi{tag}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    ip("netns", "add", ns)
    try:
        ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
        ip("addr", "add", "10.77.0.1/24", "dev", outside)
        ip("link", "set", outside, "up")
        ip("-n", ns, "addr", "add", "10.77.0.2/24", "dev", inside)
        ip("-n", ns, "link", "set", inside, "up")
        yield ns, outside, inside
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _inside(ns: str, code: str, env: dict[str, str] | None = None) -> dict:
    """``code``'s printed JSON, run in the network namespace ``ns`` (ip netns exec mounts
    that namespace's /sys, as a real node has)."""
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_jobs_interface_is_checked_up_and_at_its_speed_then_down(link) -> None:
    ns, outside, inside = link
    check = (
        "import json, sys\n"
        "from steadfast.launcher.nodes.trust import check_network, job_interface\n"
        "iface = job_interface(sys.argv[1] if len(sys.argv) > 1 else '10.77.0.1')\n"
        "print(json.dumps({'iface': iface, **{k: check_network(iface, g).__dict__\n"
        "                  for k, g in (('any', 0.0), ('fast', 100.0))}}))\n"
    )
    found = _inside(ns, check)
    assert found["iface"] == inside  # the route to the rendezvous host leaves by it
    assert found["any"]["failed"] is None
    speed = found["any"]["figure"]  # a veth says 10 Gb/s; a kernel may leave it unsaid
    if speed is not None:
        assert (
            found["fast"]["failed"] is not None
            and "below node_min_link_gbps=100" in (found["fast"]["failed"])
        )
    chosen = _inside(ns, check, env={"NCCL_SOCKET_IFNAME": "^docker,sfi"})
    assert chosen["iface"] == inside  # a prefix, after an exclusion
    subprocess.run(["ip", "link", "set", outside, "down"], check=True, timeout=30)
    down = _inside(ns, check)
    failed = down["any"]["failed"]  # down, or lowerlayerdown: as the kernel says it
    assert failed is not None and f"{inside}'s link is" in failed and "down" in failed


def test_no_interface_to_check_is_said_not_failed() -> None:
    assert job_interface("127.0.0.1", environ={}) is None
    assert job_interface(None, environ={}) is None
    skipped = check_network(None, 0.0)
    assert skipped.failed is None and skipped.skipped and "rendezvous" in skipped.skipped
    gone = check_network("no-such-nic0", 0.0)
    assert gone.failed is not None and "no-such-nic0 is not there" in gone.failed


def test_an_infiniband_port_that_is_not_active_is_not_trusted(tmp_path: Path) -> None:
    """No InfiniBand here: the port's files as the kernel lays them out (``ib0``'s device
    and its HCA's ports), read by the same check."""
    net = tmp_path / "net" / "ib0"
    port = net / "device" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (net / "operstate").write_text("up\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    assert check_network("ib0", 100.0, sysfs=tmp_path).figure == 200.0
    slow = check_network("ib0", 400.0, sysfs=tmp_path)
    assert slow.failed is not None and "200 Gb/s, below node_min_link_gbps=400" in slow.failed
    (port / "state").write_text("1: DOWN\n")
    down = check_network("ib0", 0.0, sysfs=tmp_path)
    assert down.failed is not None and "mlx5_0/1 is 1: DOWN" in down.failed


def test_a_restart_waits_for_the_previous_workers_gpu_memory() -> None:
    """The wait itself, on a real process: its memory counts until it exits (NVML
    counts a live process's memory the same way); past the bound, the node is not
    trusted, naming the MiB still held."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])

    def held(pids) -> int:  # MiB held: 512 while the process lives
        return 512 if worker.poll() is None else 0

    began = time.monotonic()
    freed = gpu_memory_freed([worker.pid], 30.0, held=held)
    assert freed.failed is None and freed.figure == 0.0
    assert time.monotonic() - began >= 0.5  # it waited for the exit
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        late = gpu_memory_freed(
            [stuck.pid], 0.5, held=lambda pids: 512 if stuck.poll() is None else 0
        )
        assert late.failed is not None and "still hold 512 MiB" in late.failed
    finally:
        stuck.kill()
        stuck.wait()
    worker.wait()


def test_without_an_nvidia_driver_the_gpu_memory_check_is_skipped_with_the_reason() -> None:
    check = gpu_memory_freed([os.getpid()], 1.0)
    if check.skipped is None:
        pytest.skip("an NVIDIA driver is here: tests/gpu checks NVML for real")
    assert "NVML" in check.skipped or "nvidia-ml-py" in check.skipped
    assert check.failed is None


def test_the_health_check_runs_them_and_says_each_figure(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("STEADFAST_EVENTS", str(log))
    ft = FaultToleranceConfig(node_check_mounts=f"{tmp_path},{tmp_path}/gone")
    problem = health_check(ft, GpuCheck(0), rendezvous_host="localhost")
    assert problem is not None and problem[0] == "storage" and "gone is not there" in problem[1]
    said = [json.loads(line) for line in log.read_text().splitlines()]
    (check,) = [e for e in said if e["kind"] == "node_check"]
    assert (check["cause"], check["passed"]) == ("storage", False) and check["reason"]
    assert health_check(FaultToleranceConfig(node_check_mounts=str(tmp_path)), GpuCheck(0)) is None
