"""``steadfast launch``'s main: the flags read, the run's event log decided, torch's
elastic agent (:class:`~.agent.FTAgent`) run, and its outcome turned into the exit
code (:mod:`steadfast.launcher` has the table)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from .exit_codes import (
    EXIT_BAD_CONFIG,
    EXIT_JOB_END_HANG,
    EXIT_LAUNCHER_ERROR,
    EXIT_NO_PROGRESS,
    EXIT_NODE_UNHEALTHY,
    EXIT_OK,
    EXIT_REASONS,
    EXIT_SILENT_CORRUPTION,
)
from .retries import job_retry, node_lost_exit, rerun_exit

__all__ = ["PRESTART_ENV", "console_main", "exit_now", "get_args_parser", "main"]

logger = logging.getLogger("steadfast.launcher")

#: ``STEADFAST_TEMPLATE_PRESTART=0`` starts the worker template only once the agent
#: exists (after the launcher imported torch), as before the prestart: the baseline of
#: ``bench/bench_launch_start.py``, and a way out if an import-time setting must come
#: from the launcher.
PRESTART_ENV = "STEADFAST_TEMPLATE_PRESTART"


def _launch(argv: list[str]) -> int:
    """Run the launcher; its start and end are events of the run's log (for any
    script: the report's wall time and the node's story come from them)."""
    from .. import events

    run = _Run()
    code = EXIT_LAUNCHER_ERROR
    reason = "the launcher raised"
    try:
        code = _launch_agent(argv, run)
        reason = EXIT_REASONS.get(code) or (
            f"stopped by signal {code - 128}" if code > 128 else f"exit {code}"
        )
        if run.detail:
            reason = f"{reason}: {run.detail}"
        return code
    except BaseException as exc:
        reason = f"the launcher raised {type(exc).__name__}: {exc}"
        raise
    finally:
        if run.started:
            events.emit("launcher_end", exit_code=code, reason=reason, no_progress=run.no_progress)


@dataclass
class _Run:
    """What the launcher's end event tells of its run."""

    started: bool = False
    #: the progress guard's count at the end (carried into a requeue: :mod:`.budget`)
    no_progress: int = 0
    #: the error that ended it, in words, where the exit code alone does not say
    detail: str = ""


def _launch_agent(argv: list[str], run: _Run) -> int:
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
        SilentCorruptionError,
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
    args = split.parse(parser)
    single_node_default = (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    )
    if args.standalone or single_node_default:  # a private store on a free port
        args.rdzv_backend, args.rdzv_endpoint = BACKEND, "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    # the backend the launcher uses (one node's default: steadfast's, not torch's static)
    events.emit(
        "launcher_start",
        nnodes=str(args.nnodes),
        nproc_per_node=str(args.nproc_per_node),
        entrypoint=str(args.training_script),
        max_restarts=int(args.max_restarts),
        rdzv_backend=str(args.rdzv_backend),
        process_start=events.process_start_time(),  # its imports are the run's start-up
    )
    run.started = True
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
            rdzv_endpoint=str(config.rdzv_endpoint or ""),
            **kwargs,
        )
        agents.append(agent)
        return agent

    ledger = _ledger(split.ft, str(args.rdzv_id))
    metrics = _metrics(split, agents, str(args.rdzv_id))
    try:
        _handle_signals_now(config.signals_to_handle)
        seam.launch_agent(make_agent, config, cmd, list(cmd_args))
    except ChildFailedError:
        logger.error("steadfast launch: workers failed and in-job restarts are spent")
        return job_retry(split.ft)
    except RerunExit as exc:
        return rerun_exit(exc.code, split.ft)
    except NoProgressError as exc:
        logger.error("steadfast launch: %s; stopping (exit %d)", exc, EXIT_NO_PROGRESS)
        run.detail = str(exc)
        return EXIT_NO_PROGRESS
    except NodeUnhealthyError as exc:
        logger.error("steadfast launch: %s; this node leaves the job (exit %d)", exc, 74)
        return EXIT_NODE_UNHEALTHY
    except NodeLostError as exc:
        logger.error("steadfast launch: %s", exc)
        return node_lost_exit(split.ft, exc.hosts)
    except JobEndHangError as exc:
        logger.error("steadfast launch: %s (exit %d)", exc, EXIT_JOB_END_HANG)
        return EXIT_JOB_END_HANG
    except SilentCorruptionError as exc:
        logger.error("steadfast launch: %s; workers stopped (exit %d)", exc, EXIT_SILENT_CORRUPTION)
        run.detail = str(exc)
        return EXIT_SILENT_CORRUPTION
    except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
        if agents and (agents[-1].rounds > 0 or isinstance(exc, RendezvousConnectionError)):
            # the store answered once (the agent exists only once the handler reached it:
            # a spare waiting to join, or the job ran): it went with its node
            logger.error("steadfast launch: the rendezvous is out of reach: %s", exc)
            return node_lost_exit(split.ft)
        if isinstance(exc, RendezvousTimeoutError):  # the nodes never all came
            logger.error("steadfast launch: not enough nodes joined in time: %s", exc)
            return node_lost_exit(split.ft)
        raise
    except RendezvousClosedError:
        # another node ended the job (its restarts spent, or its progress guard): this
        # node's job failed too, and the launcher of SLURM_PROCID 0 may requeue it
        logger.error("steadfast launch: the job was closed by another node")
        return job_retry(split.ft)
    except SignalException as exc:
        # torch's launch_agent left the rendezvous open: other nodes may still
        # re-rendezvous under this id
        return 128 + int(exc.sigval)
    finally:
        if agents:
            run.no_progress = agents[-1].progress_guard.streak
        for agent in agents:
            try:
                agent.close()
            except Exception:  # the job's outcome is decided: its exit code stays
                logger.exception("steadfast launch: cleaning up after the workers failed")
        if ledger is not None:
            ledger.close()
        if metrics is not None:
            metrics.close()
    return EXIT_OK


def _ledger(ft: Any, run_id: str) -> Any:
    """This launcher's part of the node ledger (:mod:`steadfast.ledger`), started: its
    node's stint in the job (the Slurm job's id, else the run's), and the faults it sees
    that point at a node. None without a ledger."""
    if not ft.node_ledger:
        return None
    from .. import ledger

    try:
        store = ledger.open_ledger(ft.node_ledger)
    except ledger.LedgerError as exc:
        raise ConfigError(f"fault_tolerance.node_ledger: {exc}") from None
    recorder = ledger.Recorder(
        store, socket.gethostname(), os.environ.get("SLURM_JOB_ID") or run_id
    )
    recorder.start()
    return recorder


def _metrics(split: Any, agents: list[Any], run_id: str) -> Any:
    """The launcher's Prometheus endpoint (``--metrics-port``), None without one. The
    job-wide series come from the launcher of node rank 0; every one serves its node's."""
    if split.metrics_port is None:
        return None
    from .. import events
    from ..metrics import learned_in_force, ledger_counts, serve

    def lead() -> bool:
        group = agents[-1].get_worker_group() if agents else None
        return group is not None and int(group.group_rank or 0) == 0

    def learned() -> dict[str, float]:
        agent = agents[-1] if agents else None
        found = getattr(agent, "learned", None)
        return learned_in_force(found, split.ft) if found is not None else {}

    try:
        return serve(
            events.current_path() or "", split.metrics_port, addr=split.metrics_addr,
            sd_dir=split.metrics_sd_dir, node=socket.gethostname(), lead=lead,
            learned=learned, labels={"steadfast_job": run_id, "node": socket.gethostname()},
            ledger=ledger_counts(split.ft.node_ledger, split.ft.node_ledger_window_days)
            if split.ft.node_ledger else None,
        )  # fmt: skip
    except OSError as exc:
        raise ConfigError(f"--metrics-port {split.metrics_port}: {exc}") from None


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


def get_args_parser() -> Any:
    """``steadfast launch``'s argument parser: torchrun's with steadfast's flags (NVRx's
    ``fault_tolerance.launcher.get_args_parser``; see :func:`.args.get_args_parser`)."""
    from .args import get_args_parser as parser

    return parser()


#: What the launcher imports for its run (torch's elastic agent and torchrun's parser,
#: steadfast's agent): by a launcher that is its process's entry, without the cyclic
#: collector (:func:`.preload.uncollected`: its collections were ~0.2 s of its ~2 s of
#: CPU at each start, a requeue's included, by ``perf record``).
_IMPORTED = (
    "torch.distributed.run",
    "torch.distributed.elastic.rendezvous.api",
    "steadfast.rendezvous",
    "steadfast.launcher.agent",
    "steadfast.launcher.args",
)


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``steadfast launch``; returns the documented exit code. ``entry``: this call
    is the process's own (its console script), not a caller's in-process run."""
    from .template import discard_prestarted, prestart

    logging.basicConfig(level=logging.INFO, format="[steadfast launch] %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    wanted = os.environ.get(PRESTART_ENV, "1") != "0"  # 0: the template after the agent
    if wanted and not {"-h", "--help"} & set(args):
        prestart()  # the worker template imports torch while this process does
    if entry:
        import importlib

        from .preload import uncollected

        with uncollected():
            for name in _IMPORTED:
                importlib.import_module(name)
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
    exit_now(main(entry=True))


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
