"""Monitor a launched trainer: ingest its events, heartbeat, and stop it (gracefully, then
for good) when the job is cancelled or paused, runs past its deadline, the worker shuts down
or no longer holds the job. Returns how the process tree ended; the verdict is
worker/run/verdict.py's."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from core.db.models import JobStatus
from core.db.session import session_scope
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.jobs.state import StopReason
from core.run.jobdir import JobDir
from worker.run import process_tree
from worker.run.claim import Claim, holder
from worker.run.ingest import heartbeat, ingest_events, read_control

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
# How often the watch remembers the trainer's descendants (process_tree.Launched.track):
# psutil finds children by reading every process's /proc/<pid>/stat, ~8 ms of CPU with 150
# processes on the machine, taken from the trainer it watches when done every tick. The
# ranks and loader workers start once; anything the tree starts later is still found at
# the end by its launch tag and session (process_tree.collect).
TRACK_SECONDS = 2.0


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


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
    # Size of events.jsonl when it was last ingested to its end (-1: not yet).
    events_ingested: int = -1

    @property
    def job_id(self) -> str:
        return self.claim.job_id

    def ingest(self) -> None:
        """Move the trainer's new events into the database. A file that has not grown since
        it was last ingested to its end holds nothing new (the trainer only appends): no
        transaction then, and no load of the job row, on most ticks of a run."""
        size = file_size(self.jd.events)
        if size == self.events_ingested:
            return
        with session_scope() as s:
            while ingest_events(s, self.job_id, self.jd.root, worker_id=self.claim.worker_id,
                                attempt=self.claim.attempt):
                s.commit()
        # Lines appended meanwhile were ingested too, or grow the file past ``size``.
        self.events_ingested = size

    def tick(self, *, do_heartbeat: bool) -> tuple[bool, bool, str | None]:
        """Ingest events, maybe heartbeat, read the control flags: (held, cancel, status)."""
        self.ingest()
        with session_scope() as s:
            if do_heartbeat and not heartbeat(s, self.job_id, worker_id=self.claim.worker_id,
                                              attempt=self.claim.attempt):
                return False, False, None
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        return ctl.held, ctl.cancel_requested, ctl.status

    def until_exit(self) -> Outcome:
        exited = ExitWaiter(self.launched.popen)
        try:
            return self._until_exit(exited)
        finally:
            exited.close()

    def _until_exit(self, exited: ExitWaiter) -> Outcome:
        from worker.shutdown import shutdown_requested

        hb_every = self.settings.heartbeat_seconds
        last_hb = last_ok = time.monotonic()
        last_track = -TRACK_SECONDS
        while True:
            if self.launched.poll() is not None:
                return Outcome(returncode=self.launched.popen.returncode)
            now = time.monotonic()
            if now - last_track >= TRACK_SECONDS:
                self.launched.track()
                last_track = now
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
            exited.wait(POLL_SECONDS)

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


class ExitWaiter:
    """Sleeps until a child process exits or a timeout passes, whichever is first.

    Popen.wait(timeout) polls waitpid with sleeps that grow to 50 ms: a trainer's exit was
    seen 25 ms late on average, and an idle watch woke ~20 times a second. A pidfd (Linux
    5.3+) becomes readable the moment the process exits; elsewhere Popen.wait it is."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.fd: int | None = None
        if hasattr(os, "pidfd_open") and popen.returncode is None:
            try:
                # Not reaped yet (only this worker waits for it), so the pid is still ours.
                self.fd = os.pidfd_open(popen.pid)
            except OSError:
                self.fd = None

    def wait(self, timeout: float) -> None:
        if self.fd is None:
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            return
        select.select([self.fd], [], [], timeout)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
