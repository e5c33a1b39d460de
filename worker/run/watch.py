"""Monitor a launched trainer: ingest its events, heartbeat, and stop it (gracefully, then
for good) when the job is cancelled or paused, runs past its deadline, the worker shuts down
or no longer holds the job. Returns how the process tree ended; the verdict is
worker/run/verdict.py's."""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError

from core import jobstate
from core.db.models import JobStatus
from core.db.session import session_scope
from core.jobdir import JobDir
from core.jobstate import StopReason
from core.settings import Settings
from worker.run import process_tree
from worker.run.claim import Claim, holder
from worker.run.ingest import heartbeat, ingest_events, read_control

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5


@dataclass
class Outcome:
    returncode: int | None = None
    stop_reason: StopReason | None = None
    survivors: list[int] = field(default_factory=list)


@dataclass
class Watch:
    claim: Claim
    settings: Settings
    jd: JobDir
    launched: process_tree.Launched
    deadline: float | None
    status: str = JobStatus.running  # as this run last saw it

    @property
    def job_id(self) -> str:
        return self.claim.job_id

    def tick(self, *, do_heartbeat: bool) -> tuple[bool, bool, str | None]:
        """Ingest events, maybe heartbeat, read the control flags: (held, cancel, status)."""
        with session_scope() as s:
            while ingest_events(s, self.job_id, self.jd.root, worker_id=self.claim.worker_id,
                                attempt=self.claim.attempt):
                s.commit()
        with session_scope() as s:
            if do_heartbeat and not heartbeat(s, self.job_id, worker_id=self.claim.worker_id,
                                              attempt=self.claim.attempt):
                return False, False, None
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        return ctl.held, ctl.cancel_requested, ctl.status

    def until_exit(self) -> Outcome:
        from worker.shutdown import shutdown_requested

        hb_every = self.settings.heartbeat_seconds
        last_hb = last_ok = time.monotonic()
        while True:
            if self.launched.poll() is not None:
                return Outcome(returncode=self.launched.popen.returncode)
            self.launched.track()
            now = time.monotonic()
            reason: StopReason | None = None
            try:
                due = now - last_hb >= hb_every
                held, cancel, status = self.tick(do_heartbeat=due)
                last_ok = now
                if due:
                    last_hb = now
                if not held:
                    reason = StopReason.lost
                elif cancel:
                    reason = StopReason.cancel
                    if status == JobStatus.running:
                        with session_scope() as s:
                            jobstate.honour_cancel_running(s, self.job_id, holder(self.claim))
                    self.status = JobStatus.cancelling
                elif status == JobStatus.pausing:
                    # The same graceful stop as a cancel: the trainer saves a checkpoint at
                    # the next step boundary and exits; the runner then marks it paused.
                    reason = StopReason.pause
                    self.status = JobStatus.pausing
            except SQLAlchemyError:
                log.warning("job %s: database unavailable", self.job_id, exc_info=True)
                if now - last_ok > self.settings.heartbeat_timeout_seconds:
                    reason = StopReason.lost  # the reconciler has given the job away by now
            if reason is None and self.deadline is not None and time.time() >= self.deadline:
                reason = StopReason.timeout
            if reason is None and shutdown_requested():
                reason = StopReason.shutdown
            if reason is not None:
                return self.stop(reason)
            # Wake as soon as the trainer exits (a plain sleep made every job end up to
            # POLL_SECONDS late, 0.25 s on average, before its verdict was written).
            try:
                self.launched.popen.wait(timeout=POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, reason: StopReason) -> Outcome:
        """Graceful stop (STOP file + SIGTERM), keep heart-beating and ingesting while the
        trainer saves, SIGKILL whatever is left after the grace period, verify."""
        log.info("job %s: stopping trainer (%s)", self.job_id, reason)
        grace = 0.0 if reason == StopReason.lost else self.settings.cancel_grace_seconds
        procs = process_tree.request_stop(self.launched, stop_file=self.jd.stop)
        end = time.monotonic() + grace
        last_hb = time.monotonic()
        while procs and time.monotonic() < end:
            procs = process_tree.wait_gone(self.launched, procs, min(1.0, end - time.monotonic()))
            if reason != StopReason.lost and time.monotonic() - last_hb >= self.settings.heartbeat_seconds:
                try:
                    self.tick(do_heartbeat=True)
                except SQLAlchemyError:
                    log.warning("job %s: database unavailable while stopping", self.job_id)
                last_hb = time.monotonic()
        survivors = process_tree.kill_remaining(self.launched, procs)
        self.launched.poll()
        return Outcome(returncode=self.launched.popen.returncode, stop_reason=reason,
                       survivors=sorted(p.pid for p in survivors))
