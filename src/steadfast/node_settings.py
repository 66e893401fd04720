"""The settings of what a node must show before the job trusts it: the health checks
run before each rendezvous, and the node ledger (:mod:`steadfast.ledger`) that
remembers bad nodes across jobs. Fields of :class:`~steadfast.config.
FaultToleranceConfig` (its base class), so each is a ``--ft-<name>`` flag and a key of
the ``fault_tolerance:`` section like any other; every default is safe on a machine
without GPUs and a site without a ledger."""

from __future__ import annotations

from dataclasses import dataclass

from .validate import ConfigError, require_bool, require_number

__all__ = ["STRING_FIELDS", "NodeSettings"]

#: Fields whose command-line value is taken as written (a command, a path).
STRING_FIELDS = frozenset(
    {"node_health_check", "node_health_check_dir", "node_ledger", "node_check_mounts"}
)


@dataclass
class NodeSettings:
    """What a node must show before it is trusted.

    Attributes:
        node_health_check: A command run on the node before each rendezvous
            (``--ft-node-health-check CMD``, through ``sh -c``); a non-zero exit keeps
            the node out of the job (exit 74), its output's last line is the reason.
        node_health_check_dir: A directory (the checkpoint directory) that must be
            writable, with ``node_min_free_gb`` free, before the node joins.
        node_min_free_gb: Free space ``node_health_check_dir`` needs, in GiB.
        node_ledger: Where the node ledger lives (:mod:`steadfast.ledger`): a folder on
            the shared file system, or ``etcd://host:2379,.../prefix`` (``etcds://``:
            TLS). Each launcher records its node's hours and the faults that point at
            a node there; ``steadfast nodes`` reads it. None: no ledger.
        node_ledger_max_faults: A node with this many faults in the ledger within
            ``node_ledger_window_days`` is kept out: ``steadfast slurm`` excludes it
            from the allocation (and from a requeue's), and a launcher started on it
            refuses to join (exit 74, ``node_unhealthy`` cause ``ledger``). 0: off
            (the default): the site sets it.
        node_ledger_window_days: The window the ledger's faults and hours are counted
            over, in days.
        node_check_mounts: Folders the job writes to (comma-separated: the checkpoint
            folder, the output's), each checked before a round: there, and a 4 KiB
            write and fsync within ``node_check_write_timeout`` seconds. None: none.
        node_check_write_timeout: The bound of that write, in seconds.
        node_check_network: Check the link of the interface the job uses
            (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``, or the route to the
            rendezvous): up, at ``node_min_link_gbps`` or more. On by default: a node
            whose link is down is kept out before it joins.
        node_min_link_gbps: The least link speed (Gb/s) the site expects; 0: any.
        node_gpu_memory_free_timeout: Before a restart on the same node, how long the
            previous workers may take to free their GPU memory (NVML) before the node
            is taken for unhealthy; 0: not checked. Skipped, with the reason, without
            an NVIDIA driver.
    """

    node_health_check: str | None = None
    node_health_check_dir: str | None = None
    node_min_free_gb: float = 1.0
    node_ledger: str | None = None
    node_ledger_max_faults: int = 0
    node_ledger_window_days: float = 30.0
    node_check_mounts: str | None = None
    node_check_write_timeout: float = 30.0
    node_check_network: bool = True
    node_min_link_gbps: float = 0.0
    node_gpu_memory_free_timeout: float = 60.0

    def validate_node_settings(self, p: str) -> None:
        """Check these fields (``p``: the section's prefix, for the error)."""
        for name in sorted(STRING_FIELDS):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{p}{name}: expected a non-empty string or null, got {value!r}")
        self.node_min_free_gb = float(
            require_number(p + "node_min_free_gb", self.node_min_free_gb, minimum=0)
        )
        self.node_ledger_max_faults = int(
            require_number(
                p + "node_ledger_max_faults", self.node_ledger_max_faults, minimum=0, integer=True
            )
        )
        self.node_ledger_window_days = float(
            require_number(
                p + "node_ledger_window_days", self.node_ledger_window_days, exclusive_minimum=0
            )
        )
        self.node_check_write_timeout = float(
            require_number(
                p + "node_check_write_timeout", self.node_check_write_timeout, exclusive_minimum=0
            )
        )
        self.node_check_network = require_bool(p + "node_check_network", self.node_check_network)
        for name in ("node_min_link_gbps", "node_gpu_memory_free_timeout"):
            setattr(self, name, float(require_number(p + name, getattr(self, name), minimum=0)))
        if self.node_ledger_max_faults and not self.node_ledger:
            raise ConfigError(
                f"{p}node_ledger_max_faults: {self.node_ledger_max_faults} needs a node_ledger "
                "to count faults in"
            )
