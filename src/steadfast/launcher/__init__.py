"""``steadfast launch`` (alias ``ft_launcher``): torchrun with hang detection and in-job
restarts.

Every torchrun flag works as in torchrun (torch's own parser reads them); the FT config
comes from ``--ft-cfg-path FILE.yaml`` (a ``fault_tolerance:`` section), then
``--ft-param-<field>=VALUE`` / ``--ft-<field> VALUE`` flags. The workers are run by
:class:`~steadfast.launcher.agent.FTAgent`, torch's elastic agent plus the heartbeat
table and watcher.

The run's event log has one owner, the launcher: it decides the path once, before the
agent starts (``--events PATH``; else ``--run-dir DIR``, ``DIR/events.jsonl``; else an
inherited ``$STEADFAST_EVENTS``; else ``./steadfast_events.jsonl``, made absolute), and
exports it as ``$STEADFAST_EVENTS`` to every worker of every restart, so the launcher's
``rank_failed`` / ``restart`` and the ranks' ``step_done`` land in one file.

Exit codes (for job scripts that decide whether to requeue):

==== ===================================================================================
0    the workers finished successfully
2    bad flags or FT config (one message names the flag, field or file)
76   no progress: ``max_no_progress_restarts`` consecutive restarts completed no step
77   the workers failed and the in-job restarts (``--max-restarts``) are spent
78   as 77 or 16, and the Slurm job was requeued (``num_job_retries_on_failure`` >
     the job's failure requeues so far, from the event log; only the launcher with
     ``SLURM_PROCID`` 0 requeues)
16   restart elsewhere: a worker exited 16 (``EXIT_CODE_RESUME_TO_DISAMBIGUATE``: the
     re-run state machine reproduced an unexpected result in place, saved a checkpoint
     and must re-run the step on other hardware). Not restarted in-job, because the
     same GPUs would answer the same; the job should be resubmitted or requeued on other
     nodes (the launcher requeues it itself when job retries remain, exit 78). The
     rejected results' node and device are in the machine's tracker file.
17   do not restart: a worker exited 17 (``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``: a
     ``fatal`` result failed validation). Neither restarted in-job nor requeued.
74   this node is unhealthy: it failed its health check before a rendezvous
     (``node_health_check_dir``, its GPUs, ``--ft-node-health-check CMD``) and left the
     job, which goes on without it (a ``node_unhealthy`` event says why)
75   node lost: a node of the job was lost (or this node was cut off from the job, or
     the rendezvous store with it) and no round could form again within
     ``node_lost_timeout`` (no spare, fewer nodes than ``--nnodes``' minimum). With job
     retries left under Slurm, the job is requeued instead (78)
79   hung at the job's end: another node of the round finished its workers and this
     node's were still running ``job_end_timeout`` later (a rank stuck in its teardown,
     say); they were stopped (``rank_hung``, cause ``job_end``). The job's work ended
     on the other nodes: not restarted, not requeued
128+N the launcher was stopped by signal N (SIGTERM: 143, SIGINT: 130); the workers got
     the signal and ``workers_stop_timeout`` seconds to save before SIGKILL
==== ===================================================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from typing import Any

from ..config import ConfigError

__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_JOB_END_HANG",
    "EXIT_NODE_LOST",
    "EXIT_NODE_UNHEALTHY",
    "EXIT_NO_PROGRESS",
    "EXIT_OK",
    "EXIT_REQUEUED",
    "EXIT_RESTARTS_EXHAUSTED",
    "EXIT_RESTART_ELSEWHERE",
    "EXIT_RESULT_VALIDATION_FAILED",
    "PRESTART_ENV",
    "exit_now",
    "get_args_parser",
    "main",
]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_BAD_CONFIG = 2
EXIT_NO_PROGRESS = 76
EXIT_RESTARTS_EXHAUSTED = 77
EXIT_REQUEUED = 78
EXIT_RESTART_ELSEWHERE = 16  # = rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_RESULT_VALIDATION_FAILED = 17  # = rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION
EXIT_NODE_UNHEALTHY = 74
EXIT_NODE_LOST = 75
EXIT_JOB_END_HANG = 79
EXIT_LAUNCHER_ERROR = 1  # the launcher itself raised (a bug, or torch's own error)
_EXIT_REASONS = {
    EXIT_OK: "the workers finished successfully",
    EXIT_BAD_CONFIG: "bad flags or FT config",
    EXIT_NO_PROGRESS: "no progress: consecutive restarts completed no step",
    EXIT_RESTARTS_EXHAUSTED: "the workers failed and the in-job restarts are spent",
    EXIT_REQUEUED: "the workers failed; the Slurm job was requeued",
    EXIT_RESTART_ELSEWHERE: "restart elsewhere: a worker exited 16",
    EXIT_RESULT_VALIDATION_FAILED: "a worker exited 17: failed result validation",
    EXIT_NODE_UNHEALTHY: "this node is unhealthy and left the job",
    EXIT_NODE_LOST: "a node was lost and no round formed again",
    EXIT_JOB_END_HANG: "this node's workers outlived the job's end by job_end_timeout",
}
#: ``STEADFAST_TEMPLATE_PRESTART=0`` starts the worker template only once the agent
#: exists (after the launcher imported torch), as before the prestart: the baseline of
#: ``bench/bench_launch_start.py``, and a way out if an import-time setting must come
#: from the launcher.
PRESTART_ENV = "STEADFAST_TEMPLATE_PRESTART"


def _launch(argv: list[str]) -> int:
    """Run the launcher; its start and end are events of the run's log (for any
    script: the report's wall time and the node's story come from them)."""
    from .. import events

    started = [False]
    code = EXIT_LAUNCHER_ERROR
    reason = "the launcher raised"
    try:
        code = _launch_agent(argv, started)
        reason = _EXIT_REASONS.get(code) or (
            f"stopped by signal {code - 128}" if code > 128 else f"exit {code}"
        )
        return code
    except BaseException as exc:
        reason = f"the launcher raised {type(exc).__name__}: {exc}"
        raise
    finally:
        if started[0]:
            events.emit("launcher_end", exit_code=code, reason=reason)


def _launch_agent(argv: list[str], started: list[bool]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from .. import events, seam
    from ..rendezvous import BACKEND, register
    from .agent import (
        FTAgent,
        JobEndHangError,
        NodeLostError,
        NodeUnhealthyError,
        NoProgressError,
        RerunExit,
    )
    from .args import get_args_parser, resolve_events_path, split_argv
    from .template import discard_prestarted, keep_prestarted_if

    register()  # --rdzv-backend steadfast, whether or not the package's entry point is
    parser = torchrun.get_args_parser()
    split = split_argv(argv, parser)
    if {"-h", "--help"} & set(split.launcher_flags):  # torchrun's flags and steadfast's
        get_args_parser().print_help()
        return EXIT_OK
    logging.getLogger("steadfast").setLevel(split.ft.log_level)  # the FT config's level
    # one event log for the run: this process's events and every worker's (inherited)
    os.environ[events.EVENTS_ENV] = resolve_events_path(split.events, split.run_dir)
    if not split.ft.worker_template:
        discard_prestarted()
    args = parser.parse_args(split.torchrun_argv)
    events.emit(
        "launcher_start",
        nnodes=str(args.nnodes),
        nproc_per_node=str(args.nproc_per_node),
        entrypoint=str(args.training_script),
        max_restarts=int(args.max_restarts),
        rdzv_backend=str(args.rdzv_backend),
    )
    started[0] = True
    single_node_default = (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    )
    if args.standalone or single_node_default:  # a private store on a free port
        args.rdzv_backend, args.rdzv_endpoint = BACKEND, "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    # torch 2.13's default shares the rendezvous TCPStore with the workers, and keys of
    # the previous generation survive a restart: the restarted ranks read stale gloo
    # addresses ("connectFullMesh failed ... Connection refused", pytorch#135712).
    # A store of their own per generation avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config, cmd, cmd_args = torchrun.config_from_args(args)  # sets OMP_NUM_THREADS
    keep_prestarted_if(os.environ.get("OMP_NUM_THREADS"))
    # SIGTERM -> SIGKILL when the launcher passes a signal on: --term-timeout, else
    # torchrun's --shutdown-timeout (or its environment variable; a torch without the
    # flag, such as 2.11, has neither), else the FT config's workers_stop_timeout
    torch_timeout = getattr(config, "shutdown_timeout", None)
    asked = getattr(args, "shutdown_timeout", None) is not None
    if split.term_timeout is not None:
        term_timeout: float = split.term_timeout
    elif torch_timeout is not None and (asked or "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ):
        term_timeout = float(torch_timeout)
    else:
        term_timeout = split.ft.workers_stop_timeout
    agents: list[FTAgent] = []

    def make_agent(**kwargs: Any) -> FTAgent:
        # torch's launch_agent passes LocalElasticAgent's arguments; steadfast adds its own
        kwargs.pop("shutdown_timeout", None)
        agent = FTAgent(
            ft=split.ft,
            term_timeout=term_timeout,
            nnodes=config.max_nodes,
            local_addr=config.local_addr,
            **kwargs,
        )
        agents.append(agent)
        return agent

    try:
        _handle_signals_now(config.signals_to_handle)
        seam.launch_agent(make_agent, config, cmd, list(cmd_args))
    except ChildFailedError:
        logger.error("steadfast launch: workers failed and in-job restarts are spent")
        return _job_retry(split.ft.num_job_retries_on_failure)
    except RerunExit as exc:
        return _rerun_exit(exc.code, split.ft.num_job_retries_on_failure)
    except NoProgressError as exc:
        logger.error("steadfast launch: %s; stopping (exit %d)", exc, EXIT_NO_PROGRESS)
        return EXIT_NO_PROGRESS
    except NodeUnhealthyError as exc:
        logger.error("steadfast launch: %s; this node leaves the job (exit %d)", exc, 74)
        return EXIT_NODE_UNHEALTHY
    except NodeLostError as exc:
        logger.error("steadfast launch: %s", exc)
        return _node_lost(split.ft.num_job_retries_on_failure, exc.hosts)
    except JobEndHangError as exc:
        logger.error("steadfast launch: %s (exit %d)", exc, EXIT_JOB_END_HANG)
        return EXIT_JOB_END_HANG
    except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
        if agents and (agents[-1].rounds > 0 or isinstance(exc, RendezvousConnectionError)):
            # the store answered once (the agent exists only once the handler reached it:
            # a spare waiting to join, or the job ran): it went with its node
            logger.error("steadfast launch: the rendezvous is out of reach: %s", exc)
            return _node_lost(split.ft.num_job_retries_on_failure)
        if isinstance(exc, RendezvousTimeoutError):  # the nodes never all came
            logger.error("steadfast launch: not enough nodes joined in time: %s", exc)
            return _node_lost(split.ft.num_job_retries_on_failure)
        raise
    except RendezvousClosedError:
        # another node ended the job (its restarts spent, or its progress guard): this
        # node's job failed too, and the launcher of SLURM_PROCID 0 may requeue it
        logger.error("steadfast launch: the job was closed by another node")
        return _job_retry(split.ft.num_job_retries_on_failure)
    except SignalException as exc:
        # torch's launch_agent left the rendezvous open: other nodes may still
        # re-rendezvous under this id
        return 128 + int(exc.sigval)
    finally:
        for agent in agents:
            try:
                agent.close()
            except Exception:  # the job's outcome is decided: its exit code stays
                logger.exception("steadfast launch: cleaning up after the workers failed")
    return EXIT_OK


def _handle_signals_now(names: str) -> None:
    """Torch's agent installs its handlers (which stop the workers with the same signal)
    only when it first starts them; until then a signal it should handle, such as the
    preemption SIGUSR1 of a Slurm batch script, would kill the launcher outright
    (SIGUSR1's default action). Install the same handler from the start."""
    import signal

    from .. import seam

    handler = seam.terminate_process_handler()
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, handler)


def _node_lost(retries: int, hosts: list[str] | None = None) -> int:
    """Exit 75, or a requeue (78) while job retries remain under Slurm, away from the
    lost ``hosts``."""
    return _job_retry(retries, cause="node_lost", otherwise=EXIT_NODE_LOST, exclude=hosts or [])


def _rerun_exit(code: int, retries: int) -> int:
    """The launcher's answer to the re-run state machine's exit codes (see above)."""
    if code == EXIT_RESULT_VALIDATION_FAILED:
        logger.error(
            "steadfast launch: a worker failed result validation (exit 17); not restarting"
        )
        return EXIT_RESULT_VALIDATION_FAILED
    logger.error(
        "steadfast launch: a worker asked to resume on other hardware (exit 16); not "
        "restarting on this hardware"
    )
    from ..slurm import doubted_hosts, get_slurm_info

    # the nodes whose ranks must move: a requeue that may put them back on the same
    # node would exit 16 again, spending retries for nothing
    info = get_slurm_info()
    doubted = doubted_hosts(info.job_id, info.restart_count) if info is not None else []
    return _job_retry(
        retries, cause="restart_elsewhere", otherwise=EXIT_RESTART_ELSEWHERE, exclude=doubted
    )


def _job_retry(
    retries: int,
    cause: str = "restarts_exhausted",
    otherwise: int = EXIT_RESTARTS_EXHAUSTED,
    exclude: list[str] | None = None,
) -> int:
    """Requeue the Slurm job when job retries remain (the launcher of SLURM_PROCID 0),
    kept away from the ``exclude`` hosts; ``otherwise`` is the exit code when it is not
    requeued.

    The retries spent are the job's earlier failure requeues in the event log
    (:func:`~steadfast.slurm.failure_requeues`): a preemption or an operator's requeue
    does not spend one. Without a readable log, ``SLURM_RESTART_COUNT`` (every requeue)
    is used, which can only retry less, never more."""
    from ..slurm import failure_requeues, get_slurm_info, requeue_job

    info = get_slurm_info()
    if info is None or retries <= 0:
        return otherwise
    spent = failure_requeues(info.job_id, info.restart_count)
    counted = "failure requeues in the event log"
    if spent is None:
        spent, counted = info.restart_count, "SLURM_RESTART_COUNT"
    if spent >= retries:
        logger.error(
            "job retries spent (%d %s, num_job_retries_on_failure=%d)", spent, counted, retries
        )
        return otherwise
    if os.environ.get("SLURM_PROCID", "0") != "0":
        return EXIT_REQUEUED  # the launcher of SLURM_PROCID 0 asks Slurm
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        requeued = requeue_job(info.job_id, cause=cause, exclude=exclude or [])
        return EXIT_REQUEUED if requeued else otherwise
    except SignalException:  # Slurm's SIGTERM of the requeued job, held until the event
        return EXIT_REQUEUED


def get_args_parser() -> Any:
    """``steadfast launch``'s argument parser: torchrun's with steadfast's flags (NVRx's
    ``fault_tolerance.launcher.get_args_parser``; see :func:`.args.get_args_parser`)."""
    from .args import get_args_parser as parser

    return parser()


def main(argv: list[str] | None = None) -> int:
    """Run ``steadfast launch``; returns the documented exit code."""
    from .template import discard_prestarted, prestart

    logging.basicConfig(level=logging.INFO, format="[steadfast launch] %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    wanted = os.environ.get(PRESTART_ENV, "1") != "0"  # 0: the template after the agent
    if wanted and not {"-h", "--help"} & set(args):
        prestart()  # the worker template imports torch while this process does
    events_before = os.environ.get("STEADFAST_EVENTS")
    try:
        return _launch(args)
    except ConfigError as exc:
        print(f"steadfast launch: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    finally:
        discard_prestarted()
        # the launcher set it for its run; a caller that runs main() in-process gets
        # its own value back
        if events_before is None:
            os.environ.pop("STEADFAST_EVENTS", None)
        else:
            os.environ["STEADFAST_EVENTS"] = events_before


def console_main() -> None:
    """Entry point of the ``ft_launcher`` / ``steadfast-launch`` scripts."""
    exit_now(main())


def exit_now(code: int) -> None:
    """End the launcher process with ``code`` as the interpreter would (non-daemon
    threads joined, ``atexit`` handlers run, output flushed), but without tearing down
    the modules it imported (torch's teardown costs ~0.4 s): a launcher ends right after
    its workers, as the job's last step of a Slurm allocation should."""
    from .. import seam

    seam.interpreter_exit()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
