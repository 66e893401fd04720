"""The batch script that ``steadfast slurm`` writes: :class:`SbatchSpec` and
:func:`render_sbatch`, one ``steadfast launch`` per node through srun. Facts from real
Slurm that shape it (checked in ``tests/slurm/``, on one node and on a cluster of
network-namespace nodes):

- ``--signal=B:SIG@T`` delivers ``SIG`` to the batch shell only (without ``B:``, to the
  srun steps only); a shell blocked in a foreground ``srun`` runs its trap only after
  srun returns, so the script runs srun in the background, ``wait``s, and forwards the
  signal to srun, which passes it to every task (the launchers).
- A job without ``--no-kill`` is ended (``NODE_FAIL``) and requeued by Slurm once a node
  is DOWN (``SlurmdTimeout``). With ``--no-kill`` Slurm removes the node and the job goes
  on (what spares need), but a job that loses its *first* node, and with it the batch
  script, keeps running until its time limit: only jobs with spares are ``--no-kill``.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field

from ..config import ConfigError, parse_signal, require_number
from ..signals import sbatch_signal_option

__all__ = [
    "PREEMPT_SIGNALS",
    "RDZV_BACKENDS",
    "SbatchSpec",
    "parse_time_limit",
    "render_sbatch",
]

_TIME_FORMATS = (  # Slurm's --time forms, as regular expressions of (days, h, m, s)
    (re.compile(r"^(\d+)$", re.ASCII), ("m",)),
    (re.compile(r"^(\d+):(\d+)$", re.ASCII), ("m", "s")),
    (re.compile(r"^(\d+):(\d+):(\d+)$", re.ASCII), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$", re.ASCII), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d+)$", re.ASCII), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$", re.ASCII), ("d", "h", "m", "s")),
)
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_time_limit(text: str, field_name: str = "time") -> int:
    """Seconds in a Slurm time limit (``--time``): ``minutes``, ``minutes:seconds``,
    ``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes`` or
    ``days-hours:minutes:seconds``, rounded up to whole minutes as Slurm does. A
    :class:`ConfigError` naming ``field_name`` for any other text (``UNLIMITED``
    included: a preemption signal needs a limit)."""
    value = text.strip()
    for pattern, units in _TIME_FORMATS:
        match = pattern.match(value)
        if match:
            seconds = sum(
                int(g) * _UNIT_SECONDS[u] for g, u in zip(match.groups(), units, strict=True)
            )
            if seconds <= 0:
                break
            return -(-seconds // 60) * 60  # Slurm's resolution is the minute
    raise ConfigError(
        f"{field_name}: {text!r} is not a Slurm time limit (minutes, MM:SS, HH:MM:SS, "
        "D-HH, D-HH:MM or D-HH:MM:SS, more than zero)"
    )


#: Preemption signals the batch script can pass on: the launcher handles them (torch's
#: ``--signals-to-handle``) and its worker template ignores them. The training loop must
#: handle the one chosen (``ShutdownHandler``: SIGTERM, SIGUSR1; ``PreemptionHandler``:
#: its ``exit_signal``).
PREEMPT_SIGNALS = ("USR1", "USR2", "TERM", "HUP", "QUIT", "ALRM")


def _preempt_signal(value: str | int, field_name: str) -> str:
    """The name (``USR1``) of the preemption signal ``value`` names, one of
    :data:`PREEMPT_SIGNALS`; else a ConfigError naming ``field_name``."""
    name = parse_signal(value, field_name).name.removeprefix("SIG")
    if name not in PREEMPT_SIGNALS:
        raise ConfigError(
            f"{field_name}: SIG{name} cannot be the preemption signal; use one of "
            + ", ".join("SIG" + n for n in PREEMPT_SIGNALS)
        )
    return name


#: The rendezvous backends a batch script can name: steadfast (steadfast's own, O(1) store
#: traffic per node; its store on the first node), c10d (torch's dynamic rendezvous on
#: the same store), etcd-v2 and etcd (torch's backends on an etcd cluster;
#: ``steadfast[etcd]``).
RDZV_BACKENDS = ("steadfast", "c10d", "etcd-v2", "etcd")
#: the backends whose store is the TCPStore on the allocation's first node
_STORE_ON_FIRST_NODE = ("steadfast", "c10d")


@dataclass
class SbatchSpec:
    """What ``steadfast slurm`` writes into a batch script (see :func:`render_sbatch`).

    ``script`` and ``script_args`` are the training script and its flags; ``nodes``
    run them and ``spare_nodes`` more are allocated and wait in the rendezvous, each
    ready to take a lost node's place without a requeue;
    ``nproc_per_node`` is ``steadfast launch --nproc-per-node`` (a number, ``gpu`` or
    ``auto``); ``preempt_signal`` reaches the batch shell ``preempt_time`` seconds before
    the time limit (``--signal=B:SIG@T``, only with a ``time``); ``max_restarts`` are
    the in-job restarts and ``num_job_retries_on_failure`` the requeues after them;
    ``run_dir`` holds the event log of every incarnation of the job (and, by default,
    the output); ``sbatch_lines`` are extra ``#SBATCH`` options, ``setup`` shell lines run
    before srun (``module load``, ``source venv/bin/activate``), ``launcher_args`` extra
    ``steadfast launch`` flags (``--ft-cfg-path ft.yaml``), ``srun_args`` extra srun flags.
    ``node_ledger`` is where the launchers keep the node ledger (:mod:`steadfast.ledger`);
    with ``node_ledger_max_faults``, the nodes with that many faults in it over
    ``node_ledger_window_days`` are kept out of the job: ``exclude`` (``--exclude``; what
    ``steadfast slurm`` read from the ledger), a launcher started on one, and a requeue.
    ``rdzv_backend`` is ``steadfast`` (steadfast's own rendezvous) or ``c10d`` (torch's),
    both with the store on the allocation's first node, at ``rdzv_port``, or ``etcd-v2``
    / ``etcd`` with ``rdzv_endpoint`` naming an etcd cluster
    (``host1:2379,host2:2379,host3:2379``) outside the job: then losing any node, the
    first included, leaves the rendezvous standing.
    """

    script: str
    script_args: list[str] = field(default_factory=list)
    nodes: int = 1
    spare_nodes: int = 0
    nproc_per_node: str = "1"
    job_name: str = "steadfast"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    output: str | None = None
    error: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    preempt_signal: str = "USR1"
    preempt_time: int = 120
    max_restarts: int = 3
    num_job_retries_on_failure: int = 2
    rdzv_port: int | None = None
    rdzv_backend: str = "steadfast"
    rdzv_endpoint: str | None = None
    run_dir: str | None = None
    python: str = sys.executable
    sbatch_lines: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    launcher_args: list[str] = field(default_factory=list)
    srun_args: list[str] = field(default_factory=list)
    node_ledger: str | None = None
    node_ledger_max_faults: int = 0
    node_ledger_window_days: float = 30.0
    exclude: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """One :class:`ConfigError` naming the first field that is wrong."""
        if not self.script.strip():
            raise ConfigError("script: the training script is missing")
        for name in ("script", "python", "partition", "account", "output", "error", "run_dir"):
            value = getattr(self, name)
            spaced = name not in ("script", "python") and value is not None
            if value is not None and ("\n" in value or (spaced and re.search(r"\s", value))):
                raise ConfigError(f"{name}: {value!r} must be one word on one line")
        for name in ("nodes", "spare_nodes", "max_restarts", "num_job_retries_on_failure"):
            minimum = 1 if name == "nodes" else 0
            setattr(
                self, name, require_number(name, getattr(self, name), minimum=minimum, integer=True)
            )
        if self.rdzv_port is not None:
            self.rdzv_port = require_number("rdzv_port", self.rdzv_port, minimum=1, integer=True)
            if self.rdzv_port > 65535:
                raise ConfigError(f"rdzv_port: {self.rdzv_port} is not a TCP port (1-65535)")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ConfigError(
                f"rdzv_backend: {self.rdzv_backend!r} (expected one of {', '.join(RDZV_BACKENDS)})"
            )
        if self.rdzv_endpoint is not None and (
            not self.rdzv_endpoint.strip() or re.search(r"\s", self.rdzv_endpoint.strip())
        ):
            raise ConfigError(f"rdzv_endpoint: {self.rdzv_endpoint!r} must be one word")
        if self.rdzv_backend not in _STORE_ON_FIRST_NODE and not self.rdzv_endpoint:
            raise ConfigError(
                f"rdzv_endpoint: rdzv_backend={self.rdzv_backend} needs the etcd cluster's "
                "client addresses (host1:2379,host2:2379,host3:2379)"
            )
        nproc = str(self.nproc_per_node).strip()
        digits = nproc.isascii() and nproc.isdigit()
        if not (nproc in ("gpu", "auto", "cpu") or (digits and int(nproc) > 0)):
            raise ConfigError(
                f"nproc_per_node: expected a positive integer, 'gpu', 'cpu' or 'auto', "
                f"got {self.nproc_per_node!r}"
            )
        self.nproc_per_node = nproc
        for name in ("gpus_per_node", "cpus_per_task"):
            if getattr(self, name) is not None:
                require_number(name, getattr(self, name), minimum=1, integer=True)
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.job_name):
            raise ConfigError(f"job_name: {self.job_name!r} (letters, digits and _.+- only)")
        self.preempt_signal = _preempt_signal(self.preempt_signal, "preempt_signal")
        self.preempt_time = require_number(
            "preempt_time", self.preempt_time, minimum=0, integer=True
        )
        if self.preempt_time > 65535:  # Slurm's own limit on --signal's time
            raise ConfigError(f"preempt_time: {self.preempt_time} s is over Slurm's 65535")
        if self.time is not None:
            self.time = self.time.strip()
            limit = parse_time_limit(self.time, "time")
            if self.preempt_time >= limit:
                raise ConfigError(
                    f"preempt_time: {self.preempt_time} s before a time limit of {limit} s "
                    f"(time={self.time!r}) would signal the job before it starts"
                )
        for i, line in enumerate(self.sbatch_lines):
            opt = line.strip().removeprefix("#SBATCH").strip()
            if not opt.startswith("-") or "\n" in opt:
                raise ConfigError(f"sbatch_lines[{i}]: {line!r} is not one sbatch option")
            self.sbatch_lines[i] = opt
        for i, line in enumerate(self.setup):
            if "\n" in line:
                raise ConfigError(f"setup[{i}]: one shell line per entry, got {line!r}")
        self._validate_ledger()

    def _validate_ledger(self) -> None:
        if self.node_ledger is not None and (
            not self.node_ledger.strip() or re.search(r"\s", self.node_ledger)
        ):
            raise ConfigError(f"node_ledger: {self.node_ledger!r} must be one word")
        self.node_ledger_max_faults = require_number(
            "node_ledger_max_faults", self.node_ledger_max_faults, minimum=0, integer=True
        )
        require_number("node_ledger_window_days", self.node_ledger_window_days, exclusive_minimum=0)
        if self.node_ledger_max_faults and not self.node_ledger:
            raise ConfigError("node_ledger_max_faults: needs a node_ledger to count faults in")
        for i, name in enumerate(self.exclude):
            if not re.fullmatch(r"[A-Za-z0-9_.\[\]-]+", name):
                raise ConfigError(f"exclude[{i}]: {name!r} is not a node name")

    def sbatch_options(self) -> list[str]:
        """The ``#SBATCH`` options, in the order written."""
        run_dir = self.run_dir or f"runs/{self.job_name}"
        opts = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes + self.spare_nodes}",
            "--ntasks-per-node=1",  # one steadfast launch per node; it starts the ranks
            "--requeue",
            "--open-mode=append",  # a requeued job adds to the same output files
            f"--output={self.output or run_dir + '/slurm-%j.out'}",
        ]
        if self.spare_nodes:
            # a lost node must not end the job: a spare takes its place. Only then: a
            # --no-kill job whose *first* node is lost loses its batch script but keeps
            # running (Slurm 22.05), holding the other nodes until its time limit, while
            # without it Slurm ends such a job (NODE_FAIL) and requeues it
            opts.append("--no-kill")
        if self.error:
            opts.append(f"--error={self.error}")
        if self.time is not None:
            opts.append(f"--time={self.time}")
            if self.preempt_time > 0:
                opts.append(sbatch_signal_option(self.preempt_time, self.preempt_signal))
        for name in ("partition", "account"):
            if getattr(self, name):
                opts.append(f"--{name}={getattr(self, name)}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.exclude:
            opts.append(f"--exclude={','.join(self.exclude)}")
        return opts + list(self.sbatch_lines)


def render_sbatch(spec: SbatchSpec, command_line: str | None = None) -> str:
    """The batch script for ``spec``: ``spec.nodes`` nodes, each running one
    ``steadfast launch`` (through srun) that starts ``spec.nproc_per_node`` ranks, all
    meeting in a rendezvous (steadfast's, by default) on the first node of the allocation; with
    ``spec.spare_nodes``, that many more launchers wait there as spares.

    Faults are answered in three layers: a failed or hung rank restarts every node's
    workers in the job (``--max-restarts``); when those are spent the launcher of
    ``SLURM_PROCID`` 0 requeues the job while job retries remain (exit 17 and 76 are
    final); the preemption signal (``--signal=B:...``, sent to this batch shell only) is
    forwarded to the launchers and from them to the ranks, which save, and then the
    script requeues the job, which resumes from the latest checkpoint. Every
    incarnation appends to one event log, ``<run_dir>/events.jsonl``.
    """
    q = shlex.quote
    run_dir = spec.run_dir or f"runs/{spec.job_name}"
    handled = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    if "SIG" + spec.preempt_signal not in handled:
        handled.append("SIG" + spec.preempt_signal)
    srun = " ".join(
        [
            "srun",
            f"--nodes={spec.nodes + spec.spare_nodes}",
            "--ntasks-per-node=1",
            *(["--no-kill"] if spec.spare_nodes else []),  # the step outlives a lost node
            "--kill-on-bad-exit=0",  # the launcher of SLURM_PROCID 0 must live to requeue
            # srun does not take the batch job's --cpus-per-task (Slurm 22.05 to 23.02)
            *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else []),
            *(q(a) for a in spec.srun_args),
        ]
    )
    command = [
        srun,
        '"$SF_PYTHON" -m steadfast.cli launch',
        f"--nnodes={spec.nodes} --nproc-per-node={spec.nproc_per_node}",
        f"--rdzv-backend={spec.rdzv_backend} --rdzv-endpoint="
        + (q(spec.rdzv_endpoint) if spec.rdzv_endpoint else '"$SF_HEAD:$SF_RDZV_PORT"')
        + ' --rdzv-id="$SLURM_JOB_ID"',
        f"--max-restarts={spec.max_restarts} "
        f"--ft-num-job-retries-on-failure={spec.num_job_retries_on_failure}",
        f"--signals-to-handle={','.join(handled)}",
    ]
    if spec.node_ledger:
        command.append(
            f"--ft-node-ledger={q(spec.node_ledger)} "
            f"--ft-node-ledger-max-faults={spec.node_ledger_max_faults} "
            f"--ft-node-ledger-window-days={spec.node_ledger_window_days:g}"
        )
    if spec.launcher_args:
        command.append(" ".join(q(a) for a in spec.launcher_args))
    command.append(" ".join([q(spec.script), *(q(a) for a in spec.script_args)]))
    body = " \\\n    ".join(command)
    lines = ["#!/bin/bash"]
    lines += [
        f"# Written by `steadfast slurm`: {spec.nodes} node(s) x {spec.nproc_per_node} "
        f"process(es) of {spec.script}"
        + (f", and {spec.spare_nodes} spare node(s)." if spec.spare_nodes else "."),
    ]
    if command_line:
        lines.append(f"#   {command_line}")
    lines += [f"#SBATCH {opt}" for opt in spec.sbatch_options()]
    preempt = (
        f"SIG{spec.preempt_signal} {spec.preempt_time} s before the time limit"
        if spec.time is not None and spec.preempt_time > 0
        else f"SIG{spec.preempt_signal} (no time limit given: from scancel or a scheduler)"
    )
    lines += [
        "",
        "# Faults, in three layers:",
        f"#  1. a rank fails or hangs: every node restarts its ranks in the job "
        f"(--max-restarts={spec.max_restarts});",
        *(
            [
                f"#  -  a node is lost: one of the {spec.spare_nodes} spare node(s) waiting in "
                "the rendezvous takes",
                "#     its place in the job (--no-kill: Slurm does not end the job for it;",
                "#     the first node lost takes the batch script with it: use an etcd",
                "#     rendezvous, and see docs/guides/slurm.md, 'Losing the first node');",
            ]
            if spec.spare_nodes
            else []
        ),
        "#  2. those are spent (or a node is lost, no spare left): the launcher of",
        "#     SLURM_PROCID 0 requeues the job while job retries remain",
        f"#     (num_job_retries_on_failure={spec.num_job_retries_on_failure}), away from a "
        "lost node and from the",
        "#     node of a result to re-check on other hardware (exit 16); exit 17, a result",
        "#     that failed validation, and 76, restarts that made no progress, are final;",
        f"#  3. preemption: {preempt}",
        "#     reaches this shell only: it is passed on to the launchers (scancel --signal),",
        "#     which pass it to the ranks; they save a checkpoint and stop; then this",
        "#     script requeues the job.",
        "# A requeued job resumes from the latest checkpoint (the training script's own",
        "# resume). Every incarnation appends to one event log: steadfast report RUN_DIR.",
        "set -o pipefail",
        "",
        f"SF_PYTHON={q(spec.python)}",
        f"SF_RUN_DIR={q(run_dir)}",
        'case "$SF_RUN_DIR" in /*) ;; *) SF_RUN_DIR="$PWD/$SF_RUN_DIR" ;; esac',
        # two jobs that share their first node must not share a port: by default it
        # follows the job id (a requeued job keeps its id, and so its port)
        "SF_RDZV_PORT="
        + (str(spec.rdzv_port) if spec.rdzv_port else "$((29400 + SLURM_JOB_ID % 1000))"),
        'mkdir -p "$SF_RUN_DIR" || exit 1',
        'export STEADFAST_EVENTS="${STEADFAST_EVENTS:-$SF_RUN_DIR/events.jsonl}"',
        "# the signal that preempts this job: PreemptionHandler handles it beside its own",
        "# exit_signal (Megatron Bridge's default is SIGTERM, this job's is not always)",
        f"export STEADFAST_PREEMPT_SIGNAL={spec.preempt_signal}",
        "# the job's secret (steadfast.secret): only the job's own nodes steer its",
        "# rendezvous; one per job id, kept across its requeues, 0600 in the run folder",
        'if [ -z "${STEADFAST_JOB_SECRET:-}${STEADFAST_JOB_SECRET_FILE:-}" ]; then',
        '    export STEADFAST_JOB_SECRET_FILE="$SF_RUN_DIR/.secret-$SLURM_JOB_ID"',
        '    [ -s "$STEADFAST_JOB_SECRET_FILE" ] || "$SF_PYTHON" -c "import sys, pathlib;'
        " from steadfast.secret import make_secret_file;"
        ' make_secret_file(pathlib.Path(sys.argv[1]))" "$STEADFAST_JOB_SECRET_FILE" || exit 1',
        "fi",
        *spec.setup,
        'SF_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        '[ -n "$SF_HEAD" ] || { echo "steadfast: no first node in $SLURM_JOB_NODELIST" >&2;'
        " exit 1; }",
        'echo "steadfast: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on'
        " $SLURM_JOB_NUM_NODES node(s), rendezvous "
        + (
            f"{spec.rdzv_backend} {spec.rdzv_endpoint}"
            if spec.rdzv_endpoint
            else "$SF_HEAD:$SF_RDZV_PORT"
        )
        + '"',
        "",
        "sf_preempted=''",
        "sf_forward() {  # Slurm signalled this shell only. srun would pass on only USR1",
        "    sf_preempted=$1  # and USR2 (it ends the step on TERM): signal the steps",
        '    echo "steadfast: SIG$1 (preemption): passing it on to the launchers" >&2',
        '    scancel --signal="$1" "$SLURM_JOB_ID"',
        "}",
        f"trap 'sf_forward {spec.preempt_signal}' {spec.preempt_signal}",
        "",
        body + " &",
        "sf_srun=$!",
        "# a trapped signal ends `wait` early: wait again until srun is gone, then take",
        "# its exit status",
        'while kill -0 "$sf_srun" 2>/dev/null; do wait "$sf_srun"; done',
        'wait "$sf_srun"',
        "sf_rc=$?",
        f"trap - {spec.preempt_signal}",
        "# a launcher that got the signal exits 128+N after its ranks saved; 0 is a",
        "# finished run, which must not run again",
        'if [ -n "$sf_preempted" ] && [ "$sf_rc" -ne 0 ]; then',
        '    echo "steadfast: preempted (SIG$sf_preempted); the launchers exited $sf_rc;'
        ' requeueing job $SLURM_JOB_ID" >&2',
        '    "$SF_PYTHON" -m steadfast.cli requeue --cause preempted && exit 0',
        "fi",
        'exit "$sf_rc"',
        "",
    ]
    return "\n".join(lines)
