"""The event log's schema, as code: the common fields and every event kind with the
fields it declares (:data:`EVENT_KINDS`), and :func:`register_kind` for components that
add their own. :func:`~steadfast.events.writer.emit` checks what it writes against it,
and :meth:`~steadfast.events.reader.Event.get` what a reader asks for."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

COMMON_FIELDS: tuple[str, ...] = ("time", "kind", "rank", "step", "cause", "host", "pid", "restart")

#: Added by :func:`~steadfast.events.writer.emit` under Slurm: the job id and
#: ``SLURM_RESTART_COUNT``.
SLURM_FIELDS: tuple[str, ...] = ("slurm_job_id", "slurm_restart")


class EventLogError(ValueError):
    """An event or an event file is malformed; the message names the field or line."""


class Kind(str, Enum):
    """The name of every built-in event kind. Code that reads the log compares with
    these (``e.kind == Kind.NODE_LOST``), so a misspelt kind fails in mypy or at import
    instead of matching nothing; each is also the plain string that is written. Kinds
    added with :func:`register_kind` have no member here."""

    def __str__(self) -> str:  # "node_lost", not "Kind.NODE_LOST" (an enum's own str)
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    NAN_DETECTED = "nan_detected"
    NAN_ROLLBACK_RECOMMENDED = "nan_rollback_recommended"
    HEALTH_CHECK = "health_check"
    SHUTDOWN_REQUESTED = "shutdown_requested"
    SHUTDOWN_AGREED = "shutdown_agreed"
    SHUTDOWN_FORCED = "shutdown_forced"
    SHUTDOWN_COMPLETE = "shutdown_complete"
    PREEMPTION_SIGNAL = "preemption_signal"
    PREEMPTION_EXIT = "preemption_exit"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    CHECKPOINT_DELETED = "checkpoint_deleted"
    CHECKPOINT_FENCED = "checkpoint_fenced"
    RESTORE_VERIFIED = "restore_verified"
    RESTORE_MISMATCH = "restore_mismatch"
    RESTORE_UNVERIFIED = "restore_unverified"
    RANK_HUNG = "rank_hung"
    HANG_CONFIRMED = "hang_confirmed"
    STEPS_SEEN = "steps_seen"
    RANK_FAILED = "rank_failed"
    RANK_STOPPED = "rank_stopped"
    RESTART = "restart"
    FAULT_CULPRIT = "fault_culprit"
    NODE_LOST = "node_lost"
    NODE_JOINED = "node_joined"
    NODE_UNHEALTHY = "node_unhealthy"
    NODE_CHECK = "node_check"
    NODE_ISOLATED = "node_isolated"
    RECORD_REFUSED = "record_refused"
    LAUNCHER_START = "launcher_start"
    WORKERS_STARTED = "workers_started"
    FIRST_STEP = "first_step"
    WORKERS_EXITED = "workers_exited"
    WORKER_TEARDOWN = "worker_teardown"
    LAUNCHER_END = "launcher_end"
    EXIT_BARRIER = "exit_barrier"
    JOB_REQUEUED = "job_requeued"
    JOB_START = "job_start"
    STEP_DONE = "step_done"
    ROLLBACK = "rollback"
    JOB_END = "job_end"
    FAULT_INJECTED = "fault_injected"
    RERUN_RESULT_REJECTED = "rerun_result_rejected"
    RERUN_ELSEWHERE = "rerun_elsewhere"
    RERUN_VERDICT = "rerun_verdict"
    INPROCESS_INTERRUPTED = "inprocess_interrupted"
    INPROCESS_RESTART = "inprocess_restart"
    INPROCESS_TERMINATED = "inprocess_terminated"
    INPROCESS_RANK_REASSIGNED = "inprocess_rank_reassigned"
    STRAGGLER_REPORT = "straggler_report"
    STRAGGLER_DETECTED = "straggler_detected"
    REPLICAS_CHECKED = "replicas_checked"
    SDC_DETECTED = "sdc_detected"
    SDC_VERDICT = "sdc_verdict"
    COMPUTE_AUDITED = "compute_audited"


@dataclass(frozen=True)
class EventKind:
    """One kind of event: what it records and the kind-specific fields it may carry
    (each with what it means). :func:`emit` rejects a field that is not declared, and
    :meth:`Event.get` one that is not declared for the event's kind, so a misspelt field
    is an error at once instead of an event the report silently ignores."""

    name: str
    description: str
    fields: Mapping[str, str] = field(default_factory=dict)

    def allows(self, name: str) -> bool:
        """Whether ``name`` is a field of this kind (or a common or Slurm field)."""
        return name in self.fields or name in COMMON_FIELDS or name in SLURM_FIELDS

    def __str__(self) -> str:
        names = ", ".join(self.fields) or "none"
        return f"{self.description}; fields: {names}"


def _kinds(*specs: tuple[str, str, dict[str, str]]) -> dict[str, EventKind]:
    return {str(name): EventKind(str(name), text, fields) for name, text, fields in specs}


_WORKER = {
    "exit_code": "the worker's exit code (negative: killed by that signal)",
    "signal": "the signal's name when it was killed by one, else null",
    "local_rank": "its rank on the node",
    "worker_pid": "its process id",
}

#: Every event kind, with the fields it carries: the schema, as code. Components register
#: further kinds with :func:`register_kind` (not ad hoc), so the report and the docs have
#: one list to read.
EVENT_KINDS: dict[str, EventKind] = _kinds(
    # health / NaN detection
    (Kind.NAN_DETECTED, "a non-finite loss or gradient on some rank", {
        "source": "'loss' or 'gradients'",
        "local": "this rank's own value was non-finite",
        "ranks_affected": "how many ranks saw one",
        "consecutive": "bad steps in a row so far",
        "total": "bad steps in the run so far",
        "action": "what the detector does: warn, skip or raise",
        "value": "the loss, when it was the loss",
        "params": "the first parameters with non-finite gradients",
    }),
    (Kind.NAN_ROLLBACK_RECOMMENDED, "consecutive NaN steps reached max_consecutive", {
        "consecutive": "bad steps in a row",
        "max_consecutive": "the configured limit",
        "last_good_step": "the last step with finite values",
    }),
    (Kind.HEALTH_CHECK, "a GPU or collective health check", {
        "check": "'gpu' or 'collective'", "ok": "the result", "details": "what was measured",
    }),
    # shutdown / signals
    (Kind.SHUTDOWN_REQUESTED, "a shutdown signal arrived (cause: its name)", {
        "signal": "its number",
    }),
    (Kind.SHUTDOWN_AGREED, "ranks agreed to stop after this step", {
        "ranks_signalled": "how many ranks had the signal",
    }),
    (Kind.SHUTDOWN_FORCED, "graceful shutdown exceeded its timeout, process force-exited", {
        "timeout_sec": "the timeout", "exit_code": "the forced exit code",
    }),
    (Kind.SHUTDOWN_COMPLETE, "graceful shutdown finished (handler.finish())", {}),
    (Kind.PREEMPTION_SIGNAL, "this rank received the preemption signal (cause: its name)", {
        "signal": "its number",
    }),
    (Kind.PREEMPTION_EXIT, "all ranks stop for preemption after this step", {
        "ranks_signalled": "the ranks that had the signal",
    }),
    # checkpoints
    (Kind.CHECKPOINT_SAVED, "a checkpoint is complete and visible", {
        "path": "its folder", "bytes": "its size", "seconds": "the whole save",
        "blocking_seconds": "the part the training loop waited for",
        "digest": "its files' names, sizes and CRC-32s hashed (the ledger a later restore's "
        "proof compares the checkpoint read with)",
    }),
    (Kind.CHECKPOINT_LOADED, "a checkpoint was verified and loaded", {
        "path": "its folder", "seconds": "the load",
        "tier": "disk, memory (the rank's own snapshot) or replica (one kept on another "
        "node)", "from_rank": "the rank whose node held the snapshot (memory tier)",
        "reason": "why a disk load, not the memory tier (e.g. the world size changed)",
    }),
    (Kind.CHECKPOINT_CORRUPT, "a checkpoint failed verification; an older one (or another "
     "tier) is used (cause: verify, load, memory, replica)", {
        "path": "its folder", "reason": "what failed",
    }),
    (Kind.CHECKPOINT_DELETED, "an old checkpoint was removed (keep_last_n, or a framework "
     "rotating its own)", {"path": "its folder"}),
    (Kind.CHECKPOINT_FENCED, "a rank wrote no checkpoint: its node no longer holds the job's "
     "rendezvous (cut off, or the job went on without it)", {
        "path": "the checkpoint folder", "reason": "what the launcher answered",
    }),
    (Kind.RESTORE_VERIFIED, "a restore proven by replay: the re-done steps' losses equal "
     "those logged before the fault, bit for bit or within the manager's proof_tolerance "
     "(step: the step restored)", {
        "tier": "disk, memory or replica", "path": "the checkpoint read",
        "route": "losses, state (the re-done state against a newer checkpoint), both, or "
        "ledger (no step re-done: the checkpoint's digest is the one logged at its save, "
        "and an earlier restore of the run was proven by replay with the same keys)",
        "steps": "the re-done steps whose losses were compared",
        "against": "the newer checkpoint the re-done state equals",
        "ranks": "how many ranks compared",
        "proof_steps": "steps re-done only for the proof (a newer checkpoint held them)",
        "exact": "whether everything compared was equal bit for bit",
        "difference": "else the largest relative difference taken for rounding",
        "keys": "the restored state's keys (rank 0's)",
        "digest": "ledger: the checkpoint's digest",
    }),
    (Kind.RESTORE_MISMATCH, "a restore failed its replay proof: a re-done step's loss differs "
     "from the one logged before the fault, or the re-done state from a newer checkpoint's "
     "(step: the step restored); the workers restart "
     "without that tier's checkpoints up to that step, or stop (exit 17) when none is left", {
        "tier": "disk, memory or replica", "path": "the checkpoint read",
        "differs": "rank, step, and the loss now and the loss logged, or the objects "
        "whose state differs from the newer checkpoint's, or the checkpoint's digest and "
        "the one logged at its save",
    }),
    (Kind.RESTORE_UNVERIFIED, "a restore that could not be proven (step: the step restored)", {
        "tier": "disk, memory or replica", "path": "the checkpoint read",
        "reason": "why: no losses logged before the fault, no save after the re-done steps",
    }),
    # monitoring / launcher
    (Kind.RANK_HUNG, "a rank overstayed a timeout and is terminated (cause: what timed out)", {
        "section": "the section, or what timed out", "elapsed": "seconds since it began",
        "fault_time": "epoch seconds of when it began (the rank's last sign of progress)",
        "timeout": "the timeout", "learned": "whether the timeout was learned (not "
        "configured)", "local_rank": _WORKER["local_rank"],
        "worker_pid": _WORKER["worker_pid"],
        "process": "cause job_end: running, zombie or gone (the last two: it had exited "
        "and the launcher never learned it), unknown without a pid",
        "wchan": "cause job_end: the kernel function a running one waits in",
    }),
    (Kind.HANG_CONFIRMED, "a node's launcher confirmed a hang before ending a rank: what "
     "its ranks showed through a window (cause: no_progress, startup, progress_cap, or the "
     "timeout of a script's own heartbeat or section)", {
        "culprit": "the global rank ended, null where no culprit could be told apart",
        "where": "where the culprit was (a function, 'stopped (state T)', ...)",
        "waiting": "{where: [global ranks]} of the ranks waiting in a collective",
        "moving": "global ranks that moved (past the cap only)",
        "stack": "the culprit's Python stack, outermost frame first",
        "native": "where the culprit could not answer (its main thread held the GIL, "
                  "stopped, in D): every thread's native and Python frames, innermost "
                  "first (py-spy), or the kernel's view of its threads",
        "summary": "one line: who stopped where, where the others waited",
    }),
    (Kind.STEPS_SEEN, "iterations a node's launcher saw its lowest rank complete (a script "
     "that reports no step_done of its own; steadfast.progress)", {
        "local_rank": _WORKER["local_rank"], "worker_pid": _WORKER["worker_pid"],
        "generation": "the launcher's generation", "first": "the iteration count of the "
        "first one listed (1: the process's first)", "ends": "epoch seconds each ended",
        "base": "the script's own index of iteration 1 (an optimizer's step count), null "
        "where unknown",
    }),
    (Kind.RANK_FAILED, "a worker failed: the first of its group to go down", {
        **_WORKER, "fault_id": "its fault_culprit, where the nodes agreed on it",
    }),
    (Kind.RANK_STOPPED, "a worker that went down after another rank failed (stopped by the "
     "launcher, or it lost its peer): not a fault of its own", {
        **_WORKER, "first_failed_rank": "the rank whose failure it followed",
        "culprit_node": "the node of the fault it followed (agreed job-wide)",
        "fault_id": "that fault's fault_culprit",
    }),
    (Kind.WORKER_TEARDOWN, "a worker whose training was over (its destroy_process_group() "
     "returned, its __main__ returned, or sys.exit(0)), or whose every peer had finished, "
     "hung or died on its way out: a warning, not a fault; the agent takes it as exited 0 "
     "and the training is not run again (cause: hung, past teardown_timeout or confirmed "
     "by a look, then killed; signal; exit_code)", {
        **_WORKER, "after": "seconds from the script's end to this",
        "timeout": "teardown_timeout", "where": "a hung worker's stack, or its state",
        "native": "a hung worker's native stacks (py-spy), where its Python could not say",
        "state": "the rank's state when it was ended (steadfast.monitor.ranks.RankState)",
    }),
    (Kind.FAULT_CULPRIT, "the one culprit of a round's fault, agreed job-wide through the "
     "rendezvous store (the first confirmed claim wins); every node's launcher writes it "
     "(host: the node that writes it) once the verdict is sealed", {
        "fault_id": "the same on every node for one fault (the round's key and run id)",
        "what": "rank failed, rank hung, node lost", "node": "the culprit's host name",
        "node_rank": "its node rank in the round", "culprit_rank": "the culprit's global "
        "rank (null: the node as a whole)", "fault_time": "epoch seconds of the fault "
        "itself (the exit, the last heartbeat, the last sign of life)",
        "detected": "epoch seconds it was detected",
        "claims": "claims made for that round", "stopped": "this node's ranks that went "
        "down after it", "generation": "the writing node's round count, as its "
        "workers_started says",
    }),
    (Kind.RESTART, "the launcher restarts the worker group in-job (cause: worker_failure or "
     "membership_change)", {
        "restart_count": "restarts so far", "reason": "in words",
        "remaining_restarts": "in-job restarts left",
    }),
    # nodes (the launcher's node roster; host: the launcher that saw it)
    (Kind.NODE_LOST, "a node of the running round is lost (cause: connection_reset, silent, "
     "left or unhealthy)", {
        "node": "the lost node's host name", "node_rank": "its rank among the round's nodes",
        "how": "how it was seen, in words", "latency": "seconds from its last sign of life "
        "to the detection", "nodes": "nodes in the round it left",
    }),
    (Kind.NODE_JOINED, "a node joined the job in a later round (a spare taking a lost node's "
     "place, or a node added to an elastic job)", {
        "node": "its host name", "node_rank": "its rank among the round's nodes",
        "nodes": "nodes in the new round", "replaced": "the nodes of the previous round "
        "that are not in this one",
    }),
    (Kind.NODE_CHECK, "a check this node ran before it joined a round (cause: storage, "
     "network or gpu_memory), with its figure", {
        "figure": "what it measured: the slowest write (s), the link's speed (Gb/s), the "
        "GPU memory the previous workers still held (MiB); null where it could not tell",
        "unit": "the figure's unit", "passed": "whether the node passed it",
        "reason": "why it failed", "skipped": "why it could not run here",
    }),
    (Kind.NODE_UNHEALTHY, "this node failed its health check before a rendezvous: it does not "
     "join (cause: the check)", {"reason": "what failed"}),
    (Kind.NODE_ISOLATED, "this node lost its peers and the rendezvous at once (cause "
     "partition: a partition on its side), or found the job went on without it (cause "
     "replaced: a healed partition): its workers are stopped and write nothing", {
        "how": "in words", "nodes": "nodes in the round it was cut off from",
    }),
    (Kind.RECORD_REFUSED, "a record in the job's store that is not bound to the job's "
     "secret (forged, damaged, or another job's): ignored, never acted on; said once per "
     "key (cause: unsigned or bad_signature, where the job has a secret; malformed: not a "
     "record its nodes write)", {
        "key": "the store key", "peer": "the writer the record names, where it names one",
    }),
    # the launcher's own record of its node (host: the node), for any script
    (Kind.LAUNCHER_START, "a node's launcher started (steadfast launch)", {
        "nnodes": "--nnodes as given", "nproc_per_node": "workers per node",
        "entrypoint": "the script or program", "max_restarts": "in-job restarts allowed",
        "rdzv_backend": "the rendezvous backend",
        "process_start": "epoch seconds its process began (its imports: the run's start-up)",
    }),
    (Kind.WORKERS_STARTED, "this node's launcher started its workers for a round of the "
     "rendezvous (a generation)", {
        "generation": "this node's round count (1 for its first)",
        "restart_count": "TORCHELASTIC_RESTART_COUNT given to the workers",
        "node_rank": "this node's rank in the round", "nodes": "nodes in the round",
        "world_size": "ranks in the round", "ranks": "the global ranks started here",
        "pids": "their process ids",
        "health_check": "seconds of the node's health check before the rendezvous",
        "rendezvous": "[began, ended] epoch seconds of the rendezvous that formed this round",
        "spawn": "epoch seconds the launcher began starting the workers",
    }),
    (Kind.FIRST_STEP, "a node's lowest rank finished the first iteration of a generation: "
     "where its time went from its process start (steadfast.progress.phases; seconds, "
     "and epoch seconds for the points in time)", {
        "local_rank": _WORKER["local_rank"], "worker_pid": _WORKER["worker_pid"],
        "generation": "the launcher's generation",
        "process_start": "epoch seconds the worker began",
        "first_forward": "epoch seconds its top module's first forward began",
        "first_step_end": "epoch seconds its first iteration ended",
        "imports": "seconds in the main thread's outermost imports",
        "init_process_group": "seconds in init_process_group",
        "checkpoint_load": "seconds loading a checkpoint (torch.load, DCP, steadfast's)",
        "compile": "seconds in torch.compile's compilations",
        "first_batch": "seconds getting batches from a DataLoader",
        "setup": "the rest before the first forward: model build and the script's other "
        "work, not told apart",
        "first_step": "the rest from the first forward to the first iteration's end",
    }),
    (Kind.WORKERS_EXITED, "this node's workers of a generation ended (cause: succeeded, "
     "failed, stopped: by the launcher after a fault elsewhere, a lost node or a node "
     "joining)", {
        "generation": "as in workers_started", "exits": "per worker: rank, local_rank, "
        "pid, exit_code, signal, time (epoch seconds it exited, when known)",
        "seconds": "from workers_started to the last exit",
    }),
    (Kind.EXIT_BARRIER, "this node's workers finished and its launcher left the exit barrier "
     "(cause: all_finished; timeout, after job_end_timeout; or store_unreachable: the "
     "store's host already gone)", {
        "nodes": "nodes in the round", "waited": "seconds it waited",
        "missing": "the nodes it did not hear finish (host names; 'node rank R' where it "
        "could not tell the host)", "lost": "nodes found lost meanwhile",
    }),
    (Kind.LAUNCHER_END, "a node's launcher ended", {
        "exit_code": "its exit status", "reason": "why, in words",
        "no_progress": "consecutive failed generations without a step so far (the job's "
        "next incarnation goes on from it: max_no_progress_restarts)",
    }),
    (Kind.JOB_REQUEUED, "the Slurm job was requeued (cause: restarts_exhausted, node_lost, or "
     "restart_elsewhere after a worker's exit 16: these spend a job retry; preempted, by "
     "the batch script of steadfast slurm: spends none)", {
        "slurm_job": "the job id", "excluded": "Slurm nodes the requeued job is kept away "
        "from from now on (a lost node, the node of a result to re-check elsewhere)",
    }),
    (Kind.JOB_START, "a training process (re)started, after its restore", {
        "world_size": "ranks in the job", "resumed_from": "the checkpoint, or null",
        "process_start": "epoch seconds the process began (see job_start())",
    }),
    (Kind.STEP_DONE, "a training step completed on this rank: what the goodput report counts "
     "as productive", {"seconds": "its duration", "loss": "its loss (optional)"}),
    (Kind.ROLLBACK, "training state rolled back to a checkpoint (cause: a NaN burst, or "
     "silent_corruption: the launcher restarts the workers from the newest checkpoint "
     "proven clean)", {
        "to_step": "the step it went back to (-1: none was proven: from the start)",
        "culprits": "a corruption's culprit ranks", "attribution": "first (not seen before "
        "in this job: a transient fault if it does not come back)",
    }),
    (Kind.JOB_END, "a training process ended", {"exit_code": "its code", "reason": "why"}),
    (Kind.FAULT_INJECTED, "a simulated fault fired (steadfast.faults)", {
        "fault": "its FaultKind name", "factor": "a slowdown's factor",
    }),
    # re-run state machine
    (Kind.RERUN_RESULT_REJECTED, "a validated result was rejected on this rank", {
        "result": "the value", "invocation": "which run of the step",
    }),
    (Kind.RERUN_ELSEWHERE, "this rank reproduced its rejected result in place (or was "
     "restarted on the hardware that did): it exits 16, and the job must re-run the step "
     "on other hardware (the host of this event is the node to move away from)", {
        "hardware": "the hardware id (node/device) of the doubted result",
    }),
    (Kind.RERUN_VERDICT, "attribution of a rejected result", {
        "verdict": "transient, persistent, correct, or bad_restore (the restore it re-ran "
        "from failed its replay proof: no verdict on the hardware)",
    }),
    # in-process restart (rank: the initial rank, this process's identity for the call)
    (Kind.INPROCESS_INTERRUPTED, "an in-process restart iteration was interrupted (cause: "
     "exception, soft_timeout, hard_timeout, rank_died, heartbeat_lost, left)", {
        "iteration": "the interrupted iteration", "fault_rank": "the rank at fault",
        "detail": "in words", "first": "whether this record was the first of the iteration",
    }),
    (Kind.INPROCESS_RESTART, "this rank restarts the wrapped function in-process", {
        "iteration": "the new one", "world_size": "ranks left", "active_world_size":
        "active ranks", "terminated": "ranks gone", "causes": "the interruptions",
        "seconds": "from the first interruption record to the restart",
    }),
    (Kind.INPROCESS_TERMINATED, "a rank left the job for good: terminated by its monitor "
     "process on the hard timeout, or found dead", {
        "iteration": "the iteration", "terminated_rank": "the rank",
        "signal": "the last signal sent, null if it was already dead",
    }),
    (Kind.INPROCESS_RANK_REASSIGNED, "rank assignment gave this rank a new rank", {
        "iteration": "the iteration", "from_rank": "before", "to_rank": "after",
        "world_size": "the new world size",
    }),
    # straggler detection
    (Kind.STRAGGLER_REPORT, "a periodic straggler report", {
        "relative": "{rank: relative score}", "individual": "{rank: individual score}",
        "seconds": "the report's cost",
    }),
    (Kind.STRAGGLER_DETECTED, "scores below the thresholds", {
        "ranks": "the stragglers", "relative": "the ranks below the relative threshold",
        "individual": "the ranks below the individual threshold",
        "scores": "{rank: relative score}",
    }),
    # silent data corruption (steadfast.sdc; docs/silent-corruption.md)
    (Kind.REPLICAS_CHECKED, "a node's replica checks since the last such record: the "
     "DDP replicas' fingerprints agreed", {
        "checks": "checks agreed in this generation", "last_agreed_step": "the step of "
        "the newest check every replica here agreed on (its state proven clean)",
        "replicas": "the replicas of the group", "ranks": "this node's ranks of it",
        "state_bytes": "bytes of replicated state", "chunks": "checks that cover it once",
        "proven_step": "the newest CheckpointManager checkpoint captured at or before that "
        "check: proven clean (null: none)",
    }),
    (Kind.SDC_DETECTED, "replicas that must hold the same state disagreed (cause: "
     "replica_mismatch)", {
        "check": "the check's number (optimizer steps since the workers started)",
        "replicas": "the ranks compared", "fingerprints": "{rank: fingerprint}",
    }),
    (Kind.COMPUTE_AUDITED, "every rank's pre-reduction gradients of a step were recomputed "
     "by the next rank and agreed (steadfast.sdc.audit; written by rank 0)", {
        "ranks": "the ranks audited (every one)", "every": "steps between two audits: "
        "each rank is audited this often", "seconds": "rank 0's seconds in audits so far",
    }),
    (Kind.SDC_VERDICT, "who silently corrupted its state, and since when (cause: "
     "odd_one_out, pair, or transient: an audit's mismatch not reproduced in place)", {
        "culprits": "the culprit ranks (the pair, where two cannot tell)",
        "hosts": "their hosts", "local_ranks": "their local ranks (devices)",
        "replicas": "the replicas of the group", "last_agreed_step": "the newest step "
        "every replica agreed on (null: none seen)", "first_bad_step": "the first step "
        "whose check disagreed", "clean_step": "the newest CheckpointManager checkpoint "
        "proven clean, which a rollback restores (null: none)",
    }),
)  # fmt: skip


def register_kind(
    kind: str, description: str, fields: Mapping[str, str] | Iterable[str] = ()
) -> EventKind:
    """Add an event kind to :data:`EVENT_KINDS`: what it records and its kind-specific
    fields (a mapping of name to meaning, or just the names).

    Components outside this module call this once at import so that their kinds are
    documented and accepted by :func:`emit`, with exactly those fields.
    """
    if not kind or not kind.replace("_", "").isalnum() or kind != kind.lower():
        raise EventLogError(f"event kind {kind!r} must be lower_snake_case")
    declared = dict(fields) if isinstance(fields, Mapping) else dict.fromkeys(fields, "")
    clash = sorted(set(declared) & (set(COMMON_FIELDS) | set(SLURM_FIELDS)))
    if clash:
        raise EventLogError(f"event kind {kind!r}: {clash} are common fields, not its own")
    spec = EventKind(kind, description, declared)
    EVENT_KINDS[kind] = spec
    return spec
