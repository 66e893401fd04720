"""The checks a node passes before the job trusts it, besides the GPUs and the user's
command (:mod:`.health`): what the peers check and sites ask for (NVRx 0.6-0.7's node
health checks, DLRover's node checks, Megatron-LM#4662).

- **storage**: each folder the job writes to (``node_check_mounts``) is there, a
  folder, and takes a small write and ``fsync`` within ``node_check_write_timeout``. The
  write runs in a child process: a dead NFS mount leaves a writer in uninterruptible
  sleep, which no timeout of the launcher's own could get back from;
- **the network interface the job uses**: ``NCCL_SOCKET_IFNAME``, else
  ``GLOO_SOCKET_IFNAME``, else the one the route to the rendezvous host leaves by
  (``ip route get``). Its link is up (``/sys/class/net/IF/operstate``; ``unknown``, as
  some virtual NICs say, passes) at ``node_min_link_gbps`` or more: Ethernet's speed from
  ``/sys/class/net/IF/speed``, an InfiniBand/RoCE port's from
  ``/sys/class/infiniband/DEV/ports/N/rate`` (its state must be ACTIVE);
- **GPU memory freed**: before a restart on the same node, the previous workers hold
  no GPU memory any more (NVML's compute processes, as NVRx waits for it), within
  ``node_gpu_memory_free_timeout``.

Each returns a :class:`Check`: the figure it measured, and why it failed; the caller
emits ``node_check`` with the figure, and a failure keeps the node out (exit 74).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Check", "check_mounts", "check_network", "gpu_memory_freed", "job_interface"]

#: what the write check's child runs: one small file written, fsynced and removed
_PROBE = (
    "import os, sys, tempfile, time\n"
    "t = time.monotonic()\n"
    "fd, path = tempfile.mkstemp(dir=sys.argv[1], prefix='.steadfast-check-')\n"
    "try:\n"
    "    os.write(fd, b'x' * 4096); os.fsync(fd)\n"
    "finally:\n"
    "    os.close(fd); os.unlink(path)\n"
    "print(time.monotonic() - t)\n"
)


@dataclass
class Check:
    """One check's outcome: its name, its figure (``unit``), and why it failed (None:
    it passed; ``skipped``: it could not run here, and why)."""

    name: str
    figure: float | None
    unit: str
    failed: str | None = None
    skipped: str | None = None


def check_mounts(paths: Collection[str], bound: float) -> Check:
    """Each folder of ``paths`` present and writable, a 4 KiB write and fsync within
    ``bound`` seconds; the figure: the slowest write's seconds."""
    slowest = 0.0
    for path in paths:
        if not os.path.isdir(path):
            return Check("storage", None, "s", f"{path} is not there (not mounted?)")
        try:
            done = subprocess.run(
                [sys.executable, "-c", _PROBE, path],
                capture_output=True,
                text=True,
                timeout=bound,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return Check("storage", bound, "s", f"a 4 KiB write and fsync to {path} took "
                         f"more than {bound:g} s")  # fmt: skip
        if done.returncode != 0:
            lines = (done.stderr.strip() or "no output").splitlines()
            return Check("storage", None, "s", f"{path} is not writable: {lines[-1]}")
        slowest = max(slowest, float(done.stdout.strip() or 0.0))
    return Check("storage", round(slowest, 6), "s")


# ------------------------------------------------------------------ the network
def job_interface(rendezvous_host: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The interface the job's traffic leaves by: ``NCCL_SOCKET_IFNAME``, else
    ``GLOO_SOCKET_IFNAME`` (their first name that is not an exclusion; a prefix names the
    first interface it matches), else the route to ``rendezvous_host``'s address. None:
    none can be told (no route, or the host is this one: the loopback)."""
    env = os.environ if environ is None else environ
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        for item in env.get(name, "").split(","):
            item = item.strip()
            if not item or item.startswith("^"):
                continue
            exact = item.startswith("=")
            wanted = item.lstrip("=")
            present = (
                sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
            )
            found = [i for i in present if i == wanted or (not exact and i.startswith(wanted))]
            return found[0] if found else wanted
    if not rendezvous_host:
        return None
    try:
        address = str(socket.getaddrinfo(rendezvous_host, None)[0][4][0])
    except (OSError, IndexError):
        return None
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return None
    try:
        route = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True,
                               text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bdev (\S+)", route.stdout)
    return match.group(1) if match and match.group(1) != "lo" else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # a virtual NIC's speed: EINVAL
        return None


def check_network(
    interface: str | None, min_gbps: float, sysfs: Path = Path("/sys/class")
) -> Check:
    """``interface``'s link up, at ``min_gbps`` or more; the figure: its speed (Gb/s),
    None where the link does not say (a virtual NIC)."""
    if interface is None:
        return Check("network", None, "Gb/s", skipped="no interface to check (the "
                     "rendezvous is on this host, or no route to it)")  # fmt: skip
    net = sysfs / "net" / interface
    if not net.is_dir():
        if interface in {name for _, name in socket.if_nameindex()}:
            return Check("network", None, "Gb/s", skipped=f"{sysfs} is another network "
                         f"namespace's: it has no {interface}")  # fmt: skip
        return Check("network", None, "Gb/s", f"interface {interface} is not there")
    state = _read(net / "operstate")
    if state not in ("up", "unknown"):
        return Check("network", None, "Gb/s", f"interface {interface}'s link is {state}")
    gbps: float | None = None
    speed = _read(net / "speed")
    if speed is not None and speed.lstrip("-").isdigit() and int(speed) > 0:
        gbps = int(speed) / 1000.0
    ib = net / "device" / "infiniband"
    if ib.is_dir():  # an IPoIB or RoCE interface: its ports' state and rate
        for port in sorted(ib.glob("*/ports/*")):
            port_state = _read(port / "state") or ""
            if "ACTIVE" not in port_state:
                where = f"{port.parent.parent.name}/{port.name}"
                why = f"{interface}'s InfiniBand port {where} is {port_state or 'unknown'}"
                return Check("network", None, "Gb/s", why)
            rate = re.match(r"\s*([\d.]+)\s*Gb/sec", _read(port / "rate") or "")
            if rate:
                gbps = float(rate.group(1)) if gbps is None else min(gbps, float(rate.group(1)))
    if min_gbps > 0 and gbps is not None and gbps < min_gbps:
        return Check("network", gbps, "Gb/s", f"interface {interface} runs at {gbps:g} Gb/s, "
                     f"below node_min_link_gbps={min_gbps:g}")  # fmt: skip
    return Check("network", gbps, "Gb/s")


# ------------------------------------------------------------------ GPU memory
def gpu_memory_freed(
    pids: Collection[int],
    bound: float,
    held: Callable[[Collection[int]], int] | None = None,
) -> Check:
    """Wait up to ``bound`` seconds for the processes ``pids`` (the previous workers) to
    hold no GPU memory; the figure: the MiB they still held at the end. ``held``: the
    MiB those processes hold now (NVML's by default)."""
    close: Callable[[], None] | None = None
    if held is None:
        reading = _nvml_reader()
        if isinstance(reading, str):
            return Check("gpu_memory", None, "MiB", skipped=reading)
        held, close = reading
    deadline = time.monotonic() + bound
    try:
        while True:
            mib = held(pids)
            if mib == 0:
                return Check("gpu_memory", 0.0, "MiB")
            if time.monotonic() >= deadline:
                return Check("gpu_memory", float(mib), "MiB", f"the previous workers still "
                             f"hold {mib} MiB of GPU memory after {bound:g} s")  # fmt: skip
            time.sleep(0.2)
    finally:
        if close is not None:
            close()


def _nvml_reader() -> tuple[Callable[[Collection[int]], int], Callable[[], None]] | str:
    """NVML's count of the MiB ``pids`` hold on this node's GPUs, or why it cannot be
    read here (no NVML: no NVIDIA driver, or no GPU)."""
    try:
        # nvidia-ml-py: NVIDIA's own binding, ctypes over the driver's NVML
        import pynvml  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        return f"no NVML here ({exc}): no NVIDIA driver or GPU"

    def held(pids: Collection[int]) -> int:
        wanted, total = set(pids), 0
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in wanted:
                    total += int(proc.usedGpuMemory or 0) // 2**20 or 1
        return total

    return held, pynvml.nvmlShutdown
