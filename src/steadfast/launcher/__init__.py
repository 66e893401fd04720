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

===== ===================================================================================
0     the workers finished successfully
2     bad flags or FT config (one message names the flag, field or file)
76    no progress: ``max_no_progress_restarts`` consecutive restarts completed no step
77    the workers failed and the in-job restarts (``--max-restarts``) are spent
78    as 77 or 16, and the Slurm job was requeued (``num_job_retries_on_failure`` >
      the job's failure requeues so far, from the event log; only the launcher with
      ``SLURM_PROCID`` 0 requeues)
16    restart elsewhere: a worker exited 16 (``EXIT_CODE_RESUME_TO_DISAMBIGUATE``: the
      re-run state machine reproduced an unexpected result in place, saved a checkpoint
      and must re-run the step on other hardware). Not restarted in-job, because the
      same GPUs would answer the same; the job should be resubmitted or requeued on other
      nodes (the launcher requeues it itself when job retries remain, exit 78). The
      rejected results' node and device are in the machine's tracker file.
17    do not restart: a worker exited 17 (``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``: a
      ``fatal`` result failed validation). Neither restarted in-job nor requeued.
74    this node is unhealthy: it failed its health check before a rendezvous
      (``node_health_check_dir``, its GPUs, ``--ft-node-health-check CMD``) and left the
      job, which goes on without it (a ``node_unhealthy`` event says why)
75    node lost: a node of the job was lost (or this node was cut off from the job, or
      the rendezvous store with it) and no round could form again within
      ``node_lost_timeout`` (no spare, fewer nodes than ``--nnodes``' minimum). With job
      retries left under Slurm, the job is requeued instead (78)
79    hung at the job's end: another node of the round finished its workers and this
      node's were still running ``job_end_timeout`` later (a rank stuck in its teardown,
      say); they were stopped (``rank_hung``, cause ``job_end``). The job's work ended
      on the other nodes: not restarted, not requeued
80    silent data corruption: replicas of a DDP model that must hold the same state
      disagreed (``sdc_verdict`` names the culprit, the last step all agreed on and the
      first that disagreed); the workers were stopped before more checkpoints took in
      the corrupted state. Neither restarted in-job nor requeued: restart the job from
      a checkpoint saved at or before the last agreed step, without the culprit's node
      (docs/silent-corruption.md)
128+N the launcher was stopped by signal N (SIGTERM: 143, SIGINT: 130); the workers got
      the signal and ``workers_stop_timeout`` seconds to save before SIGKILL
===== ===================================================================================
"""

from __future__ import annotations

from .exit_codes import (
    EXIT_BAD_CONFIG,
    EXIT_JOB_END_HANG,
    EXIT_NO_PROGRESS,
    EXIT_NODE_LOST,
    EXIT_NODE_UNHEALTHY,
    EXIT_OK,
    EXIT_REQUEUED,
    EXIT_RESTART_ELSEWHERE,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_RESULT_VALIDATION_FAILED,
    EXIT_SILENT_CORRUPTION,
)
from .main import PRESTART_ENV, console_main, exit_now, get_args_parser, main

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
    "EXIT_SILENT_CORRUPTION",
    "PRESTART_ENV",
    "console_main",
    "exit_now",
    "get_args_parser",
    "main",
]
