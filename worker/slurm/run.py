"""One claimed job on a SLURM cluster: adopt the attempt's SLURM job if one is already
there (the worker that submitted it died or shut down), else prepare and sbatch; then
watch squeue and the job directory until SLURM says the job ended, and conclude through the
job state machine like a local run (worker/run/local.py, whose finish and requeue it reuses).

Nothing is guessed: a SLURM job is found by its name (``ftune-<job id>-a<attempt>``)
before anything is submitted, so a crash between sbatch and the database write never
starts a job twice; and an ended job's state comes from squeue, sacct or the exit file the
batch script writes, never from its absence alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError

from core.db.models import Job, JobEvent, JobStatus
from core.db.session import execute_rowcount, session_scope
from core.graders.config import JUDGE_KEY_ENV
from core.infra.errors import ErrorCode
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.jobs.state import RunOutcome, StopReason
from core.policy import Refused, SlurmPool, node_cpus
from core.run.jobdir import JobDir
from core.train.lifeline import ORPHAN_GRACE_ENV, STOP_GRACE_ENV
from worker.run import process_tree
from worker.run.adapter_check import artifact_problem, final_artifact
from worker.run.claim import Claim, held_by, holder
from worker.run.grading import grades_beside
from worker.run.ingest import heartbeat, ingest_events, read_control
from worker.run.local import JobRun
from worker.run.prepare import prepare
from worker.run.trainer_log import elastic_root_cause, tail_lines
from worker.run.verdict import REQUEUE, Evidence
from worker.slurm import commands, script, states
from worker.slurm.commands import SlurmError, SlurmJob

log = logging.getLogger(__name__)

# How long squeue, sacct and the exit file may all know nothing of a submitted job before
# the run fails (SLURM lost it, or its controller's state was wiped).
VANISHED_SECONDS = 120.0
# The longest wait between two submit tries while the controller does not answer.
_SUBMIT_BACKOFF_MAX_SECONDS = 60.0
# What of the worker's launch environment the script exports itself, so the served script
# reproduces the run (the rest comes with sbatch's default --export=ALL).
_SCRIPT_ENV = ("PYTHONUNBUFFERED", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", STOP_GRACE_ENV,
               ORPHAN_GRACE_ENV)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class SlurmRun(JobRun):
    def __init__(self, claim: Claim, settings: Settings, pool: SlurmPool) -> None:
        super().__init__(claim, settings)
        self.pool = pool
        self.jd = JobDir(settings.slurm_jobs_dir / claim.job_id)
        self.slurm_job_id: str | None = None
        self.time_minutes: int | None = None
        self.run_status: str = JobStatus.running
        self.waiting: str | None = None
        self.cancel_sent_at: float | None = None
        self.killed = False

    @property
    def status(self) -> str:
        return self.run_status

    def run(self) -> str:
        try:
            if not self.adopt():
                try:
                    with self.keepalive():
                        stopped = self.submit()
                except Refused as e:
                    return self.finish(JobStatus.failed, code=e.code, message=str(e))
                if stopped is not None:
                    return stopped
            ended = self.watch_slurm()
            if isinstance(ended, str):
                return ended
            with self.keepalive():
                return self.conclude_slurm(ended)
        except Exception as e:
            log.exception("job %s: worker error", self.job_id)
            self._cancel_now()
            return self.finish(JobStatus.failed, code=ErrorCode.internal,
                               message=f"worker error: {type(e).__name__}: {e}")
        except BaseException:
            # The worker is going away: the SLURM job is not at fault and keeps running;
            # the next worker to claim the job adopts it.
            try:
                self.release("the worker was terminated")
            except Exception:
                log.exception("job %s: could not requeue; the reconciler will", self.job_id)
            raise

    # -- adopt or submit --------------------------------------------------------------

    def adopt(self) -> bool:
        """Take over the newest SLURM job of this job, unless it ended in a way that asks
        for a new attempt (node failure, preemption). One that ended while no worker
        watched, and that squeue has forgotten since, is found in accounting (sacct),
        where it runs: it is concluded, not submitted again."""
        with session_scope() as s:
            row = s.get(Job, self.job_id)
            assert row is not None, "a claimed job has a row"
            created = row.created_at
        names = [script.job_name(self.job_id, a) for a in range(1, self.claim.attempt + 1)]
        # A day early: sacct compares with the SLURM side's clock.
        found = commands.find_by_names(script.job_name_prefix(self.job_id), names,
                                       since=created - timedelta(days=1))
        if not found or found[0].state in states.REQUEUED:
            return False
        job = found[0]
        self.slurm_job_id = job.job_id
        self.time_minutes = job.time_limit_minutes  # what the submitting worker asked for
        self.note(f"adopted SLURM job {job.job_id} ({job.name}, {job.state})",
                  slurm_job_id=job.job_id)
        log.info("job %s: adopted SLURM job %s (%s)", self.job_id, job.job_id, job.state)
        return True

    def submit(self) -> str | None:
        """Prepare and sbatch; None once submitted, else the run's outcome (the controller
        never answered, or a cancel, pause or shutdown came while it did not)."""
        prepared = prepare(self.claim, self.settings, self.jd, pool=self.pool)
        spec = self.claim.spec
        assert spec is not None  # prepare refused a spec that does not parse
        dist, s = spec.distributed, self.settings
        timeout = prepared.timeout_seconds
        self.time_minutes = (math.ceil(timeout / 60) if timeout
                             else s.slurm_default_time_minutes)
        per_node = dist.processes_per_node
        # The judge's key goes to sbatch's environment only for a run that grades: the
        # batch script hands it to the grading processes and unsets it before the trainer
        # step (worker/slurm/script.py); the script's text and the job directory never hold it.
        grading = grades_beside(spec)
        judge_key = os.environ.get(JUDGE_KEY_ENV) if grading else None
        env = process_tree.trainer_env(
            extra={**prepared.env, **({JUDGE_KEY_ENV: judge_key} if judge_key else {})})
        batch = script.BatchJob(
            job_id=self.job_id, attempt=self.claim.attempt, job_dir=self.jd.root,
            partition=self.pool.partition, nodes=dist.num_machines,
            processes_per_node=per_node, time_minutes=self.time_minutes,
            python=s.slurm_rank_python or sys.executable, trainer_module=s.trainer_module,
            cpus_per_node=node_cpus(self.pool, per_node),
            gpus_per_node=per_node if self.pool.gpus_per_node else 0,
            account=s.slurm_accounts.get(self.claim.tenant_id), qos=s.slurm_qos,
            rank_prefix=tuple(s.slurm_rank_prefix),
            env={**{k: env[k] for k in _SCRIPT_ENV if k in env}, **prepared.env},
            grading=grading)
        text = script.render(batch)
        path = self.jd.root / script.SCRIPT_FILE
        path.write_text(text)
        argv = script.sbatch_argv(batch, path)
        (self.jd.root / script.EXIT_FILE).unlink(missing_ok=True)
        name = script.job_name(self.job_id, self.claim.attempt)
        submitted, stopped = self.sbatch_when_answered(name, argv, env)
        if submitted is None:
            return stopped
        self.slurm_job_id = submitted
        launch = dict(read_json(self.jd.launch) or {})
        launch.update(argv=argv, sbatch_script=text, slurm_job_id=self.slurm_job_id,
                      executor="slurm")
        with session_scope() as db:
            n = execute_rowcount(db, update(Job).where(Job.id == self.job_id, *held_by(self.claim))
                                 .values(launch=launch)
                                 .execution_options(synchronize_session=False))
            if n == 1:
                db.add(self._event(f"submitted to SLURM as job {self.slurm_job_id} ({name})",
                                   slurm_job_id=self.slurm_job_id, nodes=dist.num_machines))
        log.info("job %s attempt %d: SLURM job %s", self.job_id, self.claim.attempt,
                 self.slurm_job_id)
        return None

    def sbatch_when_answered(self, name: str, argv: list[str],
                             env: dict[str, str]) -> tuple[str | None, str | None]:
        """(SLURM job id, None) once submitted (or found submitted: a try that timed out
        may have reached the controller); (None, outcome) otherwise. A controller that does
        not answer is retried with exponential backoff for slurm_submit_retry_seconds,
        the job saying why it waits; any other sbatch failure raises at once."""
        from worker.shutdown import shutdown_requested

        give_up = time.monotonic() + self.settings.slurm_submit_retry_seconds
        delay = self.settings.slurm_poll_seconds
        tries = 0
        while True:
            tries += 1
            try:
                same = [j for j in commands.find_by_name_prefix(name) if j.name == name]
                submitted = same[0].job_id if same else commands.sbatch(argv, env=env)
            except SlurmError as e:
                if not e.unreachable:
                    raise
                if time.monotonic() + delay > give_up:
                    self.set_waiting(None)
                    return None, self.finish(
                        JobStatus.failed, code=ErrorCode.slurm_unavailable,
                        message=f"the SLURM controller did not answer {tries} submit tries "
                        f"over {self.settings.slurm_submit_retry_seconds:g} s "
                        f"(FTUNE_SLURM_SUBMIT_RETRY_SECONDS); last: {e}")
                why = f"SLURM controller not answering; submit try {tries + 1} in {delay:g} s"
                self.note(f"{why}: {e}", tries=tries, retry_in_seconds=delay)
                self.set_waiting(why)
            else:
                self.set_waiting(None)
                return submitted, None
            until = time.monotonic() + delay
            while True:
                held, cancel = self.tick(do_heartbeat=False)  # keepalive heart-beats
                if not held:
                    return None, RunOutcome.lost
                if cancel:
                    if self.run_status == JobStatus.running:
                        with session_scope() as s:
                            jobstate.honour_cancel_running(s, self.job_id, holder(self.claim))
                        self.run_status = JobStatus.cancelling
                    self.set_waiting(None)
                    return None, self.finish(JobStatus.cancelled)
                if self.run_status == JobStatus.pausing:
                    self.set_waiting(None)
                    return None, self.pause()
                if shutdown_requested():
                    self.set_waiting(None)
                    return None, self.release("the worker shut down")
                left = until - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(left, self.settings.slurm_poll_seconds))
            delay = min(delay * 2, _SUBMIT_BACKOFF_MAX_SECONDS)

    # -- watch -------------------------------------------------------------------------

    def state(self) -> SlurmJob | None:
        """The SLURM job as the controller knows it; once the controller has forgotten it
        (MinJobAge after it ended), how it ended as accounting or its exit file says; None
        while nothing says. Accounting counts only with a final state: a job the controller
        no longer knows is not running, whatever a lagging slurmdbd still says."""
        assert self.slurm_job_id is not None
        job = commands.find(self.slurm_job_id)
        if job is not None:
            return job
        job = commands.sacct_state(self.slurm_job_id)
        if job is not None and states.phase(job.state) != states.Phase.ended:
            job = None
        if job is None:
            done = read_json(self.jd.root / script.EXIT_FILE) or {}
            if str(done.get("slurm_job_id")) == self.slurm_job_id:
                rc = done.get("returncode")
                job = SlurmJob(self.slurm_job_id, "", "COMPLETED" if rc == 0 else "FAILED",
                               exit_code=rc if isinstance(rc, int) else None)
        return job

    def watch_slurm(self) -> SlurmJob | str:
        """Until SLURM says the job ended (returns it), or RunOutcome.lost / the shutdown
        outcome."""
        from worker.shutdown import shutdown_requested

        assert self.slurm_job_id is not None
        last_hb = 0.0
        last_known = time.monotonic()
        while True:
            now = time.monotonic()
            try:
                job = self.state()
            except SlurmError:
                # No answer (the controller is down or restarting) says nothing about the
                # job: only answers that do not know it count towards VANISHED_SECONDS.
                log.warning("job %s: squeue failed", self.job_id, exc_info=True)
                job, last_known = None, now
            else:
                if job is not None:
                    last_known = now
            try:
                due = now - last_hb >= self.settings.heartbeat_seconds
                held, cancel = self.tick(do_heartbeat=due)
                if due:
                    last_hb = now
            except SQLAlchemyError:
                log.warning("job %s: database unavailable", self.job_id, exc_info=True)
                held, cancel = True, False
            if not held:
                log.warning("job %s: no longer holds attempt %d; SLURM job %s left to the "
                            "next holder", self.job_id, self.claim.attempt, self.slurm_job_id)
                return RunOutcome.lost
            if cancel:
                self.cancel(job)
            if job is not None:
                phase = states.phase(job.state)
                self.set_waiting(states.waiting_for(job.state, job.reason)
                                 if phase == states.Phase.waiting else None)
                if phase == states.Phase.ended:
                    return job
            elif now - last_known > VANISHED_SECONDS:
                return SlurmJob(self.slurm_job_id, "", "VANISHED")
            if shutdown_requested():
                return self.release("the worker shut down")
            time.sleep(self.settings.slurm_poll_seconds)

    def tick(self, *, do_heartbeat: bool) -> tuple[bool, bool]:
        """Ingest events, maybe heartbeat; (still held, cancel requested)."""
        c = self.claim
        with session_scope() as s:
            while ingest_events(s, self.job_id, self.jd.root, worker_id=c.worker_id,
                                attempt=c.attempt):
                s.commit()
        with session_scope() as s:
            if do_heartbeat and not heartbeat(s, self.job_id, worker_id=c.worker_id,
                                              attempt=c.attempt):
                return False, False
            ctl = read_control(s, self.job_id, worker_id=c.worker_id, attempt=c.attempt)
        if ctl.status is not None:
            self.run_status = ctl.status
        return ctl.held, ctl.cancel_requested

    def set_waiting(self, text: str | None) -> None:
        if text == self.waiting:
            return
        with session_scope() as s:
            execute_rowcount(s, update(Job).where(Job.id == self.job_id, *held_by(self.claim))
                             .values(waiting_for=text)
                             .execution_options(synchronize_session=False))
        self.waiting = text

    def cancel(self, job: SlurmJob | None) -> None:
        """Graceful first (SIGTERM to every process of every step on every node, then the
        STOP file on the shared filesystem), scancel after the grace period; a job still
        queued is scancelled. The signal goes first: a trainer that saw STOP first could
        exit before SLURM signals the step, and children it leaves behind are no longer
        the step's for SLURM where it tracks processes by parentage (proctrack/linuxproc):
        they would keep the step's output open, and the job COMPLETING, for a minute."""
        assert self.slurm_job_id is not None
        if self.cancel_sent_at is None:
            if self.run_status == JobStatus.running:
                with session_scope() as s:
                    jobstate.honour_cancel_running(s, self.job_id, holder(self.claim))
            self.run_status = JobStatus.cancelling
            self.cancel_sent_at = time.monotonic()
            if job is not None and states.phase(job.state) == states.Phase.waiting:
                self._cancel_now()
                return
            try:
                commands.scancel(self.slurm_job_id, signal="TERM")
            except SlurmError:
                log.warning("job %s: scancel --signal failed", self.job_id, exc_info=True)
            try:
                self.jd.stop.touch()
            except OSError:
                log.warning("job %s: could not write %s", self.job_id, self.jd.stop)
        elif (not self.killed
              and time.monotonic() - self.cancel_sent_at >= self.settings.cancel_grace_seconds):
            self._cancel_now()

    def _cancel_now(self) -> None:
        if self.slurm_job_id is None or self.killed:
            return
        try:
            commands.scancel(self.slurm_job_id)
            self.killed = True
        except SlurmError:
            log.exception("job %s: scancel %s failed", self.job_id, self.slurm_job_id)

    # -- conclude ----------------------------------------------------------------------

    def conclude_slurm(self, job: SlurmJob) -> str:
        assert self.slurm_job_id is not None
        try:
            self.tick(do_heartbeat=False)  # the last events, before the final status
        except SQLAlchemyError:
            log.warning("job %s: could not ingest the last events", self.job_id, exc_info=True)
        self.set_waiting(None)
        done = read_json(self.jd.root / script.EXIT_FILE) or {}
        rc = done.get("returncode") if str(done.get("slurm_job_id")) == self.slurm_job_id \
            else job.exit_code
        artifact = final_artifact(self.jd, self.claim.spec)
        present = artifact.is_dir()
        log_tail = tail_lines(self.jd.log, n=200)
        with session_scope() as s:
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        evidence = Evidence(
            rc if isinstance(rc, int) else None,
            stop_reason=StopReason.cancel if self.cancel_sent_at is not None else None,
            adapter_present=present,
            adapter_problem=artifact_problem(artifact) if present else None,
            error=self.jd.read_error() or {},
            cancel_requested=ctl.cancel_requested,
            root_cause=elastic_root_cause(log_tail),
        )
        v = states.verdict(job.state, evidence, slurm_job_id=self.slurm_job_id,
                           time_minutes=job.time_limit_minutes or self.time_minutes,
                           memory_killed=states.memory_killed(log_tail))
        log.info("job %s: SLURM job %s ended %s -> %s", self.job_id, self.slurm_job_id,
                 job.state, v.status)
        self.note(f"SLURM job {self.slurm_job_id} ended {job.state}",
                  slurm_job_id=self.slurm_job_id, slurm_state=job.state, returncode=rc)
        if v.status == REQUEUE:
            return self.requeue(v.message or "")
        if v.status == JobStatus.cancelled and v.message:
            self.note(v.message, slurm_job_id=self.slurm_job_id, reason="cancelled_outside")
        if v.status == JobStatus.succeeded and self.claim.spec is not None \
                and self.claim.spec.evaluation is not None:
            with self.keepalive():  # the evaluation runs here, as on a local worker
                return self.evaluate(str(final_artifact(self.jd, self.claim.spec)))
        return self.finish(
            v.status, code=v.code, message=v.message,
            adapter_path=str(final_artifact(self.jd, self.claim.spec))
            if v.status == JobStatus.succeeded else None,
            with_log=v.show_log, has_error_file=not v.log_in_message, traceback=v.traceback)

    def release(self, why: str) -> str:
        """Hand the job back without touching the SLURM job: the next claim adopts it. A
        cancel that was already asked for is carried out first."""
        if self.cancel_sent_at is not None:
            self._cancel_now()
        return self.requeue(f"{why}; SLURM job {self.slurm_job_id} is adopted by the next "
                            "worker" if self.slurm_job_id else why)

    def _event(self, message: str, **data: object) -> JobEvent:
        return JobEvent(job_id=self.job_id, type="slurm", message=message,
                        data={k: v for k, v in data.items() if v is not None})

    def note(self, message: str, **data: object) -> None:
        """An event written now (best effort; the status change carries the rest)."""
        try:
            with session_scope() as s:
                s.add(self._event(message, **data))
        except SQLAlchemyError:
            log.warning("job %s: could not write event %r", self.job_id, message)

