"""The verdict on a finished run: what the evidence says the job's status is, and why.

A pure function of what the worker gathered once the trainer's process tree is gone: why
the watch loop stopped it (if it did), the exit status, error.json, the adapter check, the
cancel flag and deadline as they stand now, and the rank torch elastic saw fail first. The
runner (worker/run/local.py) gathers the evidence and writes the verdict through the guarded
transitions; this module touches no process, file or database.

Order matters: a stop the worker asked for wins (a pause only once the run's own outcome
is known: it may have finished, failed or been cancelled while it stopped); then a usable
adapter from a clean exit (the job succeeded, even if a cancel or the deadline arrived as
it finished); then a cancel or the deadline (the trainer was stopped by them, whatever it
wrote); then a kill from outside (worker/run/outside_kill.py: a system fault, so the job goes
back to the queue and resumes from its latest checkpoint, within the attempt budget, as a
lost worker's does; the ranks that failed because of it do not count); then what the
trainer itself reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.db.models import JobStatus
from core.infra.errors import ErrorCode
from core.jobs.state import StopReason
from worker.run.outside_kill import OutsideKill

REQUEUE = JobStatus.queued  # the worker shut down: the job goes back to the queue
PAUSE = JobStatus.paused  # the user paused it: the run stopped at a checkpoint


@dataclass(frozen=True)
class Evidence:
    returncode: int | None
    stop_reason: StopReason | None = None  # the watch stopped it (never lost: no verdict)
    adapter_present: bool = False  # <job_dir>/adapter exists
    adapter_problem: str | None = None  # what is wrong with it (worker/run/adapter_check.py)
    error: dict[str, Any] = field(default_factory=dict)  # error.json, {} when absent
    cancel_requested: bool = False
    deadline_passed: bool = False
    timeout_seconds: int | None = None
    root_cause: tuple[int, int] | None = None  # (rank, exit code) that failed first
    killed: OutsideKill | None = None  # a rank (or the launcher) killed from outside


@dataclass(frozen=True)
class Verdict:
    status: str  # succeeded | failed | cancelled | queued (REQUEUE) | paused (PAUSE)
    code: ErrorCode | None = None
    message: str | None = None
    # Attach the tail of trainer.log as an event; ``log_in_message``: also append it to the
    # message (no classified error: the log tail is all the user gets).
    show_log: bool = False
    log_in_message: bool = False
    traceback: str | None = None  # from error.json, shown with the log tail


def timeout_message(timeout_seconds: int | None) -> str:
    return f"the job ran past its time limit of {timeout_seconds} s"


def decide(e: Evidence) -> Verdict:
    if e.stop_reason == StopReason.shutdown:
        return Verdict(REQUEUE, message="the worker shut down")
    if e.stop_reason == StopReason.cancel:
        return Verdict(JobStatus.cancelled)
    if e.stop_reason == StopReason.timeout:
        return _timed_out(e)
    if e.stop_reason == StopReason.pause:
        return _paused(e)

    rc = e.returncode
    if rc == 0 and e.adapter_present and e.adapter_problem is None:
        return Verdict(JobStatus.succeeded)
    if e.cancel_requested:
        return Verdict(JobStatus.cancelled)
    if e.deadline_passed:
        return _timed_out(e)
    if rc != 0 and e.killed is not None:
        return Verdict(REQUEUE, message=f"{e.killed.describe()}: a system fault, not the "
                       "job's; it resumes from its latest checkpoint")
    if rc == 0 and e.adapter_problem is not None:
        return Verdict(JobStatus.failed, ErrorCode.adapter_invalid,
                       f"the trainer's adapter is unusable: {e.adapter_problem}")
    if rc == 0:
        return Verdict(JobStatus.failed, ErrorCode.trainer_crashed,
                       "trainer exited 0 without an adapter", show_log=True)
    return _trainer_failed(e)


def _paused(e: Evidence) -> Verdict:
    """The watch stopped the run for a pause: paused, unless the run finished with a usable
    adapter first, a cancel arrived meanwhile, or the trainer reported a failure of its own
    (a non-zero exit with error.json; a kill after the grace period writes none)."""
    if e.returncode == 0 and e.adapter_present and e.adapter_problem is None:
        return Verdict(JobStatus.succeeded)
    if e.cancel_requested:
        return Verdict(JobStatus.cancelled)
    if e.returncode not in (0, None) and e.error:
        return _trainer_failed(e)
    return Verdict(PAUSE)


def _timed_out(e: Evidence) -> Verdict:
    return Verdict(JobStatus.failed, ErrorCode.timeout, timeout_message(e.timeout_seconds))


def _trainer_failed(e: Evidence) -> Verdict:
    """Non-zero exit: the trainer's own classification (error.json) if it wrote one, else
    trainer_crashed; named after the rank that failed first when that was another one."""
    err = e.error
    code = err.get("code")
    if code not in {c.value for c in ErrorCode}:
        code = ErrorCode.trainer_crashed
    message = str(err.get("message") or f"trainer exited with code {e.returncode}")
    cause = e.root_cause
    if cause is not None and not err:
        message = f"rank {cause[0]} failed first (exit code {cause[1]}): {message}"
    elif cause is not None and cause[0] != err.get("rank"):
        # error.json came from a rank that failed *because* another one died first (a
        # collective whose peer vanished): name the one that failed first.
        message = (f"rank {cause[0]} failed first (exit code {cause[1]}; see the log); "
                   f"then rank {err.get('rank')}: {message}")
    return Verdict(JobStatus.failed, ErrorCode(code), message, show_log=True,
                   log_in_message=not err, traceback=err.get("traceback"))
