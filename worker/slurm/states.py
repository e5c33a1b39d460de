"""SLURM job states -> what the service does, as pure functions.

A SLURM job is waiting (PENDING and the like: its reason becomes the job's ``waiting_for``),
running, or over. An ended job's verdict: COMPLETED and FAILED are judged on the evidence
like a local run (worker/run/verdict.py: COMPLETED alone is not success, the adapter must be
verified; a step SLURM killed for its memory -> out_of_memory); TIMEOUT and DEADLINE ->
failed (timeout); OUT_OF_MEMORY -> failed (out_of_memory); NODE_FAIL, PREEMPTED, BOOT_FAIL ->
requeued (the next attempt resumes from the latest checkpoint); CANCELLED -> cancelled,
saying who cancelled it when it was not the service.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum

from core.db.models import JobStatus
from core.infra.errors import ErrorCode
from core.jobs.state import StopReason
from worker.run.verdict import REQUEUE, Evidence, Verdict, decide


class Phase(StrEnum):
    waiting = "waiting"
    running = "running"
    ended = "ended"


WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                     "RESV_DEL_HOLD", "SUSPENDED", "STOPPED", "RESIZING"})
# COMPLETING: ranks may still be alive on a node; the job has not ended until SLURM says so.
RUNNING = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "UPDATE_DB"})
JUDGED_ON_EVIDENCE = frozenset({"COMPLETED", "FAILED"})
REQUEUED = frozenset({"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"})
TIMED_OUT = frozenset({"TIMEOUT", "DEADLINE"})


# What slurmstepd and srun write into the job's output (trainer.log) when SLURM kills a step
# for its memory: the cgroup OOM killer (ConstrainRAMSpace) and the accounting poller
# (JobAcctGatherParams=OverMemoryKill). Seen with SLURM 22.05: the ranks run in step 0, not in
# the batch step, so the job itself ends FAILED (srun's exit status), not OUT_OF_MEMORY.
_MEMORY_KILL = re.compile(r"slurmstepd.*(oom-kill event|exceeded memory limit|Exceeded job "
                          r"memory limit)|srun: error: .*: tasks? [0-9,-]+: Out Of Memory")


def memory_killed(log_lines: Iterable[str]) -> bool:
    """Whether SLURM killed a step of the job for exceeding its memory on a node."""
    return any(_MEMORY_KILL.search(line) for line in log_lines)


def phase(state: str) -> Phase:
    """Unknown states count as ended only if SLURM calls them final; else as running."""
    if state in WAITING:
        return Phase.waiting
    if state in RUNNING:
        return Phase.running
    return Phase.ended


def waiting_for(state: str, reason: str | None) -> str:
    """The job's ``waiting_for`` while SLURM holds it back."""
    shown = reason if reason and reason != "None" else "its turn"
    return f"SLURM {state.lower()}: {shown}"


def verdict(state: str, evidence: Evidence, *, slurm_job_id: str,
            time_minutes: int | None = None, memory_killed: bool = False) -> Verdict:
    """The job's outcome once its SLURM job ended in ``state``; ``memory_killed``: the
    job's output says SLURM killed a step for its memory (``memory_killed()``)."""
    if evidence.stop_reason == StopReason.cancel:
        return Verdict(JobStatus.cancelled)
    if state in JUDGED_ON_EVIDENCE:
        judged = decide(evidence)
        if memory_killed and judged.status == JobStatus.failed:
            return Verdict(JobStatus.failed, ErrorCode.out_of_memory,
                           f"SLURM killed a rank of job {slurm_job_id} for exceeding its "
                           "memory limit on a node", show_log=True)
        return judged
    if state in TIMED_OUT:
        limit = f" of {time_minutes} min" if time_minutes else ""
        return Verdict(JobStatus.failed, ErrorCode.timeout,
                       f"SLURM stopped job {slurm_job_id} at its time limit{limit} ({state})")
    if state == "OUT_OF_MEMORY":
        return Verdict(JobStatus.failed, ErrorCode.out_of_memory,
                       f"SLURM job {slurm_job_id} ran out of memory on a node (OUT_OF_MEMORY)",
                       show_log=True)
    if state in REQUEUED:
        return Verdict(REQUEUE, message=f"SLURM job {slurm_job_id} ended {state}; requeued to "
                       "resume from the latest checkpoint")
    if state == "CANCELLED":
        if evidence.cancel_requested:
            return Verdict(JobStatus.cancelled)
        return Verdict(JobStatus.cancelled, message=f"SLURM job {slurm_job_id} was cancelled "
                       "outside the service (scancel by an operator or SLURM itself)")
    return Verdict(JobStatus.failed, ErrorCode.internal,
                   f"SLURM job {slurm_job_id} ended in state {state}", show_log=True)
