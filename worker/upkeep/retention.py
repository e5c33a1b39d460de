"""Retention: how long finished jobs keep their history, as the operator sets it
(settings ``retention_events_days``, ``retention_logs_days``, ``retention_artifacts_days``;
None keeps it forever). Every worker applies it every ``retention_interval_seconds``
(``start_thread``); ``ftune retention`` applies it once. docs/operations-retention.md says
what grows per job.

What goes, per kind:
  events     the job's job_events rows, and <job_dir>/events.jsonl
  logs       <job_dir>/trainer.log
  artifacts  <job_dir>/checkpoints/, adapter/, model/ (and their .tmp leftovers); the job
             then says no adapter or model is available (jobs.adapter_path cleared)
What stays: the job row (status, spec, progress, metrics, error), its attempts and usage,
its checkpoint rows with their metrics, and spec.json, launch.json, error.json.

Only jobs that finished (succeeded, failed, cancelled) longer ago than the setting are
touched: nothing of a queued, running, paused or recently finished job. Every delete says so
again in its own statement, and a finished job never moves again (core/jobs/state.py). The
artifacts of a job that an unfinished job continues from (``model.from_job``) are kept.

Bounded and off the request path: events go ``retention_batch_rows`` rows per transaction,
each committed on its own, so the API's writes never wait long behind retention. A mark per
kind (retention_marks: the finish time and id of the last job done) makes each pass read only
the jobs finished since the previous one, in finish order (ix_jobs_finished_at).
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import and_, delete, exists, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import Job, JobEvent, RetentionMark, utcnow
from core.db.session import execute_rowcount
from core.infra.settings import Settings
from core.jobs.state import FINISHED, UNFINISHED
from core.run.jobdir import (
    ADAPTER_DIR,
    ADAPTER_TMP_DIR,
    CHECKPOINTS_DIR,
    EVENTS_FILE,
    LOG_FILE,
    MODEL_DIR,
    MODEL_TMP_DIR,
)

log = logging.getLogger(__name__)

KINDS = ("events", "logs", "artifacts")
JOBS_PER_STEP = 100  # jobs read per step of a pass
FILES = {"events": (EVENTS_FILE,), "logs": (LOG_FILE,),
         "artifacts": (CHECKPOINTS_DIR, ADAPTER_DIR, ADAPTER_TMP_DIR, MODEL_DIR, MODEL_TMP_DIR)}

Maker = sessionmaker[Session]


def cutoffs(settings: Settings, now: datetime) -> dict[str, datetime]:
    """Each kind the settings limit, with the finish time before which it goes."""
    out = {}
    for kind in KINDS:
        days: float | None = getattr(settings, f"retention_{kind}_days")
        if days is not None:
            out[kind] = now - timedelta(days=days)
    return out


def apply_retention(maker: Maker, settings: Settings, now: datetime | None = None, *,
                    max_jobs: int | None = None) -> dict[str, int]:
    """One pass: for each kind the settings limit, the jobs pruned (up to ``max_jobs``)."""
    done = {}
    for kind, cutoff in cutoffs(settings, now or utcnow()).items():
        done[kind] = _prune_kind(maker, settings, kind, cutoff, max_jobs)
    return done


def _after_mark(mark: RetentionMark | None) -> list[object]:
    if mark is None:
        return []
    return [or_(Job.finished_at > mark.finished_at,
                and_(Job.finished_at == mark.finished_at, Job.id > mark.job_id))]


def _prune_kind(maker: Maker, settings: Settings, kind: str, cutoff: datetime,
                max_jobs: int | None) -> int:
    pruned = 0
    while max_jobs is None or pruned < max_jobs:
        step = JOBS_PER_STEP if max_jobs is None else min(JOBS_PER_STEP, max_jobs - pruned)
        with maker() as s:
            mark = s.get(RetentionMark, kind)
            # By finish time alone (a status condition would lead SQLite, which has no
            # statistics, to read by status); the status is checked below and in each delete.
            rows = s.execute(
                select(Job.id, Job.status, Job.finished_at, Job.job_dir)
                .where(Job.finished_at < cutoff, *_after_mark(mark))  # type: ignore[arg-type]
                .order_by(Job.finished_at, Job.id).limit(step)).all()
            in_use = _continued_from(s) if kind == "artifacts" and rows else set()
        if not rows:
            break
        for r in rows:
            if r.status in FINISHED and r.id not in in_use:
                _prune_job(maker, settings, kind, r.id, r.job_dir, cutoff)
        last = rows[-1]
        with maker() as s:
            mark = s.get(RetentionMark, kind)
            if mark is None:
                s.add(RetentionMark(kind=kind, finished_at=last.finished_at, job_id=last.id))
            else:
                mark.finished_at, mark.job_id = last.finished_at, last.id
            s.commit()
        pruned += len(rows)
    return pruned


def _continued_from(s: Session) -> set[str]:
    """Jobs whose artifacts an unfinished job starts from (``model.from_job``)."""
    specs = s.scalars(select(Job.spec).where(Job.status.in_(UNFINISHED)))
    return {str(m["from_job"]) for spec in specs
            if isinstance(m := (spec or {}).get("model"), dict) and m.get("from_job")}


def _still_old(job_id: str, cutoff: datetime) -> object:
    """SQL: the job is (still) finished, before ``cutoff``."""
    return exists().where(Job.id == job_id, Job.status.in_(FINISHED), Job.finished_at < cutoff)


def _prune_job(maker: Maker, settings: Settings, kind: str, job_id: str,
               job_dir: str | None, cutoff: datetime) -> None:
    if kind == "events":
        while True:
            with maker() as s:
                batch = (select(JobEvent.id).where(JobEvent.job_id == job_id)
                         .order_by(JobEvent.job_id, JobEvent.id)
                         .limit(settings.retention_batch_rows))
                n = execute_rowcount(s, delete(JobEvent).where(
                    JobEvent.id.in_(batch.scalar_subquery()),
                    _still_old(job_id, cutoff)))  # type: ignore[arg-type]
                s.commit()
            if n < settings.retention_batch_rows:
                break
    if kind == "artifacts":
        with maker() as s:
            s.execute(update(Job).where(Job.id == job_id, _still_old(job_id, cutoff))  # type: ignore[arg-type]
                      .values(adapter_path=None).execution_options(synchronize_session=False))
            s.commit()
    root = job_root(settings, job_id, job_dir)
    if root is not None:
        for name in FILES[kind]:
            _remove(root / name)


def job_root(settings: Settings, job_id: str, job_dir: str | None) -> Path | None:
    """The job's directory if it is where a worker makes one (``<jobs dir>/<job id>``);
    None otherwise: retention deletes nothing outside the jobs directories."""
    if not job_dir:
        return None
    root = Path(job_dir).resolve()
    homes = {settings.jobs_dir.resolve(), settings.slurm_jobs_dir}
    if root.name != job_id or root.parent not in homes:
        log.warning("retention: job %s has its directory outside the jobs directories (%s); "
                    "its files are left", job_id, root)
        return None
    return root


def _remove(path: Path) -> None:
    """A file or a tree (a link is removed, never followed)."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path)
    except OSError:
        log.warning("retention: could not remove %s", path, exc_info=True)


def start_thread(maker_of: Callable[[], Maker], settings: Settings,
                 stop: threading.Event) -> threading.Thread | None:
    """A daemon thread that applies the retention every ``retention_interval_seconds``
    (with jitter: many workers do not start in step; passes beside each other are safe, each
    delete being guarded). None when no retention is set."""
    if not cutoffs(settings, utcnow()):
        return None

    def loop() -> None:
        interval = settings.retention_interval_seconds
        while not stop.wait(interval * random.uniform(0.8, 1.2)):
            try:
                if done := apply_retention(maker_of(), settings):
                    log.info("retention: pruned %s", done)
            except Exception:
                log.exception("retention pass failed")

    thread = threading.Thread(target=loop, name="ftune-retention", daemon=True)
    thread.start()
    return thread
