"""One run of one job on this worker, in layers:

claim (worker/run/claim.py) -> prepare (worker/run/prepare.py: the run policy, spec.json, YAML)
-> launch (worker/run/process_tree.py) -> watch (worker/run/watch.py: events, heartbeat, cancel, pause,
deadline) -> verdict (worker/run/verdict.py: a pure function of the evidence) -> finish.

This module runs the lifecycle and is the only one that ends it: every status change is a
named transition of the job state machine (core/jobs/state.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy.exc import SQLAlchemyError

from core.db.models import JobEvent, JobStatus, utcnow
from core.db.session import get_sessionmaker, session_scope
from core.evals.job_evaluation import evaluate_job
from core.infra.errors import ErrorCode
from core.infra.logging import log_context
from core.infra.settings import Settings, get_settings
from core.jobs import state as jobstate
from core.jobs.dispatch import enqueue_after_commit
from core.jobs.state import RunOutcome, StopReason
from core.policy import Refused
from core.run.jobdir import JobDir, checkpoint_step
from worker.run import process_tree
from worker.run.adapter_check import artifact_problem, final_artifact
from worker.run.claim import (
    Claim,
    claim_next,
    holder,
    log_unclaimed,
    ring_workers_with_work,
    worker_identity,
)
from worker.run.grading import GradingProcess, start_grading
from worker.run.ingest import heartbeat, read_control
from worker.run.outside_kill import outside_kill
from worker.run.prepare import prepare
from worker.run.trainer_log import elastic_root_cause, tail_lines
from worker.run.verdict import PAUSE, REQUEUE, Evidence, decide
from worker.run.watch import Outcome, Watch

log = logging.getLogger(__name__)


class JobRun:
    def __init__(self, claim: Claim, settings: Settings) -> None:
        self.claim = claim
        self.settings = settings
        self.job_id = claim.job_id
        self.jd = JobDir(settings.jobs_dir / claim.job_id)
        self.launched: process_tree.Launched | None = None
        self.grading: GradingProcess | None = None
        self.watch: Watch | None = None
        self.timeout_seconds: int | None = None
        self.notes: list[JobEvent] = []  # written with the final status

    @property
    def status(self) -> str:
        """The job's status as this run last saw it (the watch may have moved it to
        cancelling, or seen it pausing)."""
        return self.watch.status if self.watch is not None else JobStatus.running

    def run(self) -> str:
        try:
            try:
                with self.keepalive():
                    prepared = prepare(self.claim, self.settings, self.jd)
            except Refused as e:
                return self.finish(JobStatus.failed, code=e.code, message=str(e))
            self.timeout_seconds = prepared.timeout_seconds
            self.grading = start_grading(self.claim.spec, self.jd,
                                         process_tree.new_tag(self.job_id, self.claim.attempt))
            env = {**prepared.env, **(self.grading.trainer_env() if self.grading else {})}
            self.launched = process_tree.spawn(
                prepared.argv, log_path=self.jd.log,
                tag=process_tree.new_tag(self.job_id, self.claim.attempt),
                env=process_tree.trainer_env(extra=env), cpus=prepared.cpus)
            log.info("job %s attempt %d: launched pid %d", self.job_id, self.claim.attempt,
                     self.launched.pid)
            self.watch = Watch(self.claim, self.settings, self.jd, self.launched,
                               prepared.deadline)
            outcome = self.watch.until_exit()
            # The end of the trainer as the worker saw it (the service-overhead bench's
            # timeline: what follows is this worker's alone).
            log.info("job %s attempt %d: trainer exited with %s%s", self.job_id,
                     self.claim.attempt, outcome.returncode,
                     f" ({outcome.stop_reason})" if outcome.stop_reason else "")
            with self.keepalive():
                return self.conclude(outcome)
        except Exception as e:
            log.exception("job %s: worker error", self.job_id)
            self._kill_now()
            return self.finish(JobStatus.failed, code=ErrorCode.internal,
                               message=f"worker error: {type(e).__name__}: {e}")
        except BaseException:
            # Cold shutdown, KeyboardInterrupt, SystemExit: the job is not at fault.
            self._kill_now()
            try:
                self.requeue("the worker was terminated")
            except Exception:
                log.exception("job %s: could not requeue; the reconciler will", self.job_id)
            raise
        finally:
            if self.grading is not None:
                self.grading.stop()

    @contextmanager
    def keepalive(self) -> Iterator[None]:
        """Heartbeats from a thread while the watch loop is not running: preparing (imports,
        dataset hashing, model configs) and concluding (killing the tree, verifying the
        adapter) may take longer than the heartbeat timeout, and the reconciler would give
        away a job whose worker is alive and well."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.settings.heartbeat_seconds):
                try:
                    with session_scope() as s:
                        if not heartbeat(s, self.job_id, worker_id=self.claim.worker_id,
                                         attempt=self.claim.attempt):
                            return  # finished, or no longer ours
                except SQLAlchemyError:
                    log.warning("job %s: heartbeat failed", self.job_id, exc_info=True)

        t = threading.Thread(target=beat, name=f"ftune-keepalive-{self.job_id}", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(timeout=30)

    def _kill_now(self) -> None:
        if self.launched is None:
            return
        try:
            process_tree.stop_tree(self.launched, grace=0)
        except Exception:
            log.exception("job %s: killing the trainer failed", self.job_id)

    # -- finishing -------------------------------------------------------------------

    def conclude(self, outcome: Outcome) -> str:
        assert self.launched is not None and self.watch is not None
        # Whatever the launcher left behind (it exited, a rank or loader may not have).
        leftovers = process_tree.kill_remaining(self.launched)
        survivors = sorted({*outcome.survivors, *(p.pid for p in leftovers)})
        if survivors:
            self.notes.append(JobEvent(
                job_id=self.job_id, type="log", message=f"processes survived SIGKILL: {survivors}",
                data={"level": "error", "pids": survivors}))
        if outcome.stop_reason == StopReason.lost:
            log.warning("job %s: this worker no longer holds attempt %d; trainer stopped",
                        self.job_id, self.claim.attempt)
            return RunOutcome.lost
        try:
            self.watch.tick(do_heartbeat=False)  # the last events, before the final status
        except SQLAlchemyError:
            log.warning("job %s: could not ingest the last events", self.job_id, exc_info=True)

        evidence = self.evidence(outcome)
        verdict = decide(evidence)
        if verdict.status == REQUEUE:
            return self.requeue(verdict.message or "")
        if verdict.status == PAUSE:
            return self.pause()
        if verdict.status == JobStatus.succeeded and self.claim.spec is not None \
                and self.claim.spec.evaluation is not None:
            return self.evaluate(str(final_artifact(self.jd, self.claim.spec)))
        return self.finish(
            verdict.status, code=verdict.code, message=verdict.message,
            adapter_path=str(final_artifact(self.jd, self.claim.spec))
            if verdict.status == JobStatus.succeeded else None,
            with_log=verdict.show_log, has_error_file=not verdict.log_in_message,
            traceback=verdict.traceback)

    def evaluate(self, artifact: str) -> str:
        """A job with an evaluation is final once its models are scored
        (core/evals/job_evaluation.py; the keepalive heart-beats meanwhile). If a model
        cannot be scored the job fails with evaluation_failed, its verified artifact kept
        (downloadable); a cancel asked meanwhile stops it between runs."""
        def canceled() -> bool:
            with session_scope() as s:
                ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                                   attempt=self.claim.attempt)
            self._saw(ctl.held, ctl.status)
            return ctl.cancel_requested

        result = evaluate_job(get_sessionmaker(), self.job_id, self.settings,
                              worker_id=self.claim.worker_id, adapter_path=artifact,
                              canceled=canceled)
        if result.status == "canceled":
            return self.finish(JobStatus.cancelled, adapter_path=artifact)
        if result.status == "failed":
            return self.finish(JobStatus.failed, code=ErrorCode.evaluation_failed,
                               message=result.error, adapter_path=artifact)
        return self.finish(JobStatus.succeeded, adapter_path=artifact)

    def evidence(self, outcome: Outcome) -> Evidence:
        """What the verdict needs, read from the job directory and the job row."""
        assert self.watch is not None and self.launched is not None
        if outcome.stop_reason not in (None, StopReason.pause):  # the watch stopped it: that decides
            return Evidence(outcome.returncode, outcome.stop_reason,
                            timeout_seconds=self.timeout_seconds)
        artifact = final_artifact(self.jd, self.claim.spec)
        present = artifact.is_dir()
        with session_scope() as s:
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        self._saw(ctl.held, ctl.status)
        deadline = self.watch.deadline
        lines = tail_lines(self.jd.log, n=200)
        root_cause = elastic_root_cause(lines)
        return Evidence(
            outcome.returncode,
            outcome.stop_reason,
            adapter_present=present,
            adapter_problem=artifact_problem(artifact) if present else None,
            error=self.jd.read_error() or {},
            cancel_requested=ctl.cancel_requested,
            deadline_passed=deadline is not None and time.time() >= deadline,
            timeout_seconds=self.timeout_seconds,
            root_cause=root_cause,
            killed=outside_kill(outcome.returncode, root_cause, lines,
                                pids={p.pid for p in self.launched.seen} | {self.launched.pid},
                                cgroup_oom_kills=self.launched.oom.kills_since()),
        )

    def _saw(self, held: bool, status: str | None) -> None:
        """Record the status the job row has now: the final move names where it comes from,
        and a cancel may have turned a pausing job into a cancelling one meanwhile."""
        if held and status is not None and self.watch is not None:
            self.watch.status = status

    def finish(self, status: str, *, code: ErrorCode | None = None, message: str | None = None,
               adapter_path: str | None = None, with_log: bool = False,
               has_error_file: bool = True, traceback: str | None = None) -> str:
        events, self.notes = list(self.notes), []
        if with_log:
            lines = tail_lines(self.jd.log)
            if lines and not has_error_file:
                # No classified error: the log tail is all the user gets, so put it in view.
                message = f"{message}\n--- last {len(lines)} lines of trainer.log ---\n" + \
                    "\n".join(lines)
            events.append(JobEvent(job_id=self.job_id, type="log",
                                   message=f"last {len(lines)} lines of trainer.log",
                                   data={"level": "error", "lines": lines,
                                         "traceback": traceback}))
        now = utcnow()
        with session_scope() as s:
            ok = jobstate.finish(s, self.job_id, holder(self.claim), previous=self.status,
                                 to=JobStatus(status), now=now, error_code=code,
                                 error_message=message, adapter_path=adapter_path)
            if ok:
                s.add_all(events)
        if not ok:
            log.warning("job %s: not finished as %s; this worker no longer holds it",
                        self.job_id, status)
            return RunOutcome.lost
        log.info("job %s: %s%s", self.job_id, status, f" ({code})" if code else "")
        return str(status)

    def requeue(self, why: str) -> str:
        """Give the job back to the queue (the attempt stays counted) and enqueue it again:
        its message was acked long ago. A cancel that was requested wins."""
        with session_scope() as s:
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        self._saw(ctl.held, ctl.status)
        if ctl.cancel_requested:
            return self.finish(JobStatus.cancelled)
        if ctl.held and ctl.status == JobStatus.pausing:
            return self.pause()  # the user asked for it; the latest checkpoint resumes it
        with session_scope() as s:
            ok = jobstate.requeue(s, self.job_id, holder(self.claim), previous=self.status,
                                  why=why, now=utcnow())
            if ok:
                s.add(JobEvent(job_id=self.job_id, type="requeued", message=why,
                               data={"attempt": self.claim.attempt}))
                enqueue_after_commit(s, self.job_id)
        if not ok:
            return RunOutcome.lost
        log.info("job %s: back to queued (%s)", self.job_id, why)
        return str(JobStatus.queued)

    def pause(self) -> str:
        """pausing -> paused once every process of the run is gone: the job holds no worker
        (its GPUs are free) until it is resumed, from its latest checkpoint, on any worker.
        A cancel that arrived meanwhile wins."""
        latest = self.jd.latest_checkpoint()
        step = checkpoint_step(latest) if latest is not None else None
        events, self.notes = list(self.notes), []
        with session_scope() as s:
            ok = jobstate.pause(s, self.job_id, holder(self.claim), now=utcnow(),
                                checkpoint_step=step)
            if ok:
                s.add_all(events)
        if not ok:
            with session_scope() as s:
                ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                                   attempt=self.claim.attempt)
            if ctl.held and ctl.status == JobStatus.cancelling:
                self._saw(ctl.held, ctl.status)
                self.notes = events
                return self.finish(JobStatus.cancelled)
            log.warning("job %s: not paused; this worker no longer holds it", self.job_id)
            return RunOutcome.lost
        log.info("job %s: paused at checkpoint step %s", self.job_id, step)
        return str(JobStatus.paused)

def run_job(job_id: str = "",
            executor: Callable[[Claim, Settings], JobRun] | None = None) -> str:
    """One doorbell: run the job the scheduler places on this worker's free GPUs (the
    database decides which; ``job_id`` only says which submission rang). Returns its final
    status, or RunOutcome.skipped (nothing fits here now) / RunOutcome.lost. When the run ends, workers that
    could now start a job (this one included: its GPUs are free) get a doorbell.
    ``executor`` makes the run of a claimed job (worker/run/executor.py); default: here."""
    settings = get_settings()
    worker_id = worker_identity(settings)
    # No job_id: this worker's own doorbell (core/jobs/dispatch.py ring_worker).
    claim = claim_next(settings, worker_id, own_bell=not job_id)
    if claim is None:
        if job_id:
            log_unclaimed(job_id)
        return RunOutcome.skipped
    # Every line about this run (claim, launch, finish, the monitor's) carries the job id.
    with log_context(job_id=claim.job_id, attempt=claim.attempt):
        log.info("job %s: claimed attempt %d as %s%s (rang for %s)", claim.job_id,
                 claim.attempt, worker_id,
                 f" on GPUs {list(claim.gpu_ids)}" if claim.gpu_ids else "",
                 job_id or "a free slot")
        status = (executor or JobRun)(claim, settings).run()
    try:
        ring_workers_with_work(settings)
    except Exception:
        log.exception("could not ring the workers; the reconciler re-sends waiting jobs")
    return status
