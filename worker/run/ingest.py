"""Job-directory -> database: events, denormalised progress and metrics, checkpoints,
heartbeats and the cancel flag.

Ingestion is exactly-once through the stored byte offset: the rows for a batch of events
and the new ``events_offset`` commit in one transaction, and the offset moves only if it
still holds the value the batch was read from (compare-and-set). A crash before the commit
re-reads the same lines; two ingesters racing over one job insert each line once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import and_, delete, select, update
from sqlalchemy.orm import Session

from core.db.models import Checkpoint, Job, JobAttempt, JobEvent, JobStatus, utcnow
from core.db.session import execute_rowcount
from core.jobs import state as jobstate
from core.jobs.usage import attempt_reported
from core.run.jobdir import JobDir, read_events
from core.webhooks import outbox

log = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 500
# Progress fields of a preference objective or grpo (core/train/callbacks.py METRICS), kept
# as the job's latest preference_metrics.
PREFERENCE_METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "kl",
                      "reward", "reward_std", "completion_length")


def _ts(event: dict[str, Any]) -> datetime:
    t = event.get("time")
    if isinstance(t, (int, float)) and math.isfinite(t):
        return datetime.fromtimestamp(float(t), tz=UTC)
    return utcnow()


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _int(v: Any) -> int | None:
    f = _num(v)
    return None if f is None else int(f)


def event_message(event: dict[str, Any]) -> str:
    kind = event.get("type")
    if kind == "log":
        return str(event.get("message", ""))
    if kind == "progress":
        loss = _num(event.get("loss"))
        tail = f" loss {loss:.4g}" if loss is not None else ""
        return f"step {event.get('step')}/{event.get('total_steps')}{tail}"
    if kind == "eval":
        return f"eval at step {event.get('step')}: eval_loss {event.get('eval_loss')}"
    if kind == "checkpoint":
        return f"checkpoint at step {event.get('step')}"
    if kind == "stopped":
        return f"stopped at step {event.get('step')} ({event.get('reason')})"
    if kind == "finished":
        return f"finished at step {event.get('step')}"
    if kind == "saved":
        return "adapter saved"
    if kind == "started":
        return f"training started (world size {event.get('world_size')})"
    if kind == "phase":
        return str(event.get("message") or event.get("phase"))
    if kind == "tracking":
        names = [k for k in event if k not in ("type", "time")]
        return f"tracking runs: {', '.join(names)}"
    return str(event.get("message", ""))


def _peak_mb(event: dict[str, Any]) -> float | None:
    """Peak memory of a memory event: GPU if reported, else CPU."""
    gpu = [_num(v) for k, v in event.items() if k.startswith("gpu_mb") and "peak" in k]
    gpu_vals = [v for v in gpu if v is not None]
    if gpu_vals:
        return max(gpu_vals)
    return _num(event.get("cpu_mb_peak"))


def _fold(job: Job, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Column values from a batch of events (later events win), for one UPDATE."""
    values: dict[str, Any] = {}
    memory = dict(job.memory or {})
    memory_changed = False
    tracking = dict(job.tracking or {})
    tracking_changed = False
    peak = job.peak_memory_mb
    training_started = job.training_started_at
    for ev in events:
        kind = ev.get("type")
        if kind in ("progress", "finished", "stopped"):
            # As reported, not a running max: a resumed attempt restarts at its checkpoint.
            step = _int(ev.get("step"))
            if step is not None:
                values["step"] = step
        if kind in ("started", "progress"):
            total = _int(ev.get("total_steps"))
            if total is not None:
                values["total_steps"] = total
        if kind == "progress":
            for src, dst in (("epoch", "epoch"), ("loss", "train_loss"),
                             ("learning_rate", "learning_rate"),
                             ("tokens_per_second", "tokens_per_second")):
                v = _num(ev.get(src))
                if v is not None:
                    values[dst] = v
            rewards = {k: _num(ev.get(k)) for k in PREFERENCE_METRICS if k in ev}
            if rewards:
                values["preference_metrics"] = rewards
            if training_started is None:
                training_started = _ts(ev)
                values["training_started_at"] = training_started
        elif kind == "eval":
            v = _num(ev.get("eval_loss"))
            if v is not None:
                values["eval_loss"] = v
        elif kind == "finished":
            v = _num(ev.get("train_loss"))
            if v is not None:
                values["train_loss"] = v
        elif kind == "started":
            values.update(_resolved(job, ev))
            values["phase"] = {"phase": "training", "message": "training",
                               "attempt": ev.get("attempt")}
        elif kind == "phase":
            values["phase"] = {k: v for k, v in ev.items() if k != "type"}
        elif kind == "tracking":
            # One entry per tracker; a retried attempt reports the same runs again.
            tracking.update({k: v for k, v in ev.items() if k not in ("type", "time")})
            tracking_changed = True
        elif kind == "memory":
            key = str(ev.get("phase", "unknown"))
            if ev.get("rank") not in (None, 0):
                key = f"{key}/rank{ev.get('rank')}"
            memory[key] = {k: v for k, v in ev.items() if k not in ("type", "time")}
            memory_changed = True
            p = _peak_mb(ev)
            if p is not None and (peak is None or p > peak):
                peak = p
                values["peak_memory_mb"] = p
    if memory_changed:
        values["memory"] = memory
    if tracking_changed:
        values["tracking"] = tracking
    return values


# Fields of the "started" event that say how the job ran (the job object's `run`).
RUN_FIELDS = ("total_steps", "num_train_epochs", "world_size", "strategy", "distributed_type",
              "device", "mixed_precision", "effective_batch_size", "gradient_checkpointing",
              "attempt", "trainable_params", "total_params", "data")


def _resolved(job: Job, ev: dict[str, Any]) -> dict[str, Any]:
    """The spec that ran, completed with what the trainer resolved at start."""
    out: dict[str, Any] = {
        "run_info": {**{k: ev.get(k) for k in RUN_FIELDS if k in ev},
                     "worker_id": job.worker_id, "executor": "local"}
    }
    modules = ev.get("target_modules")
    resolved = job.resolved_spec
    if modules is not None and resolved is not None and "target_modules" in (
        resolved.get("peft") or {}
    ):
        out["resolved_spec"] = {**resolved, "peft": {**resolved["peft"],
                                                     "target_modules": modules}}
    return out


def _attempt_usage(job: Job, events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Tokens each attempt reported (its latest counts), and the processes and device its
    "started" event says were in effect."""
    out: dict[int, dict[str, Any]] = {}
    attempt = job.attempt
    for ev in events:
        kind = ev.get("type")
        if kind == "started":
            attempt = _int(ev.get("attempt")) or attempt
            world = _int(ev.get("world_size"))
            row = out.setdefault(attempt, {})
            if world is not None and world > 0:
                row["processes"] = world
            if isinstance(ev.get("device"), str):
                row["device"] = str(ev["device"])[:16]
        if kind in ("progress", "finished", "stopped"):
            n = _int(ev.get("attempt")) or attempt
            for src, dst in (("tokens_trained", "tokens"), ("loss_tokens_trained", "loss_tokens")):
                v = _int(ev.get(src))
                if v is not None and v >= 0:
                    out.setdefault(n, {})[dst] = v
    return out


def _upsert_checkpoint(session: Session, job_id: str, job_dir: Path, ev: dict[str, Any]) -> None:
    step = _int(ev.get("step"))
    if step is None:
        return
    rel = str(ev.get("path") or f"checkpoints/checkpoint-{step}")
    path = str((job_dir / rel).resolve()) if not Path(rel).is_absolute() else rel
    raw_metrics = ev.get("metrics")
    metrics: dict[str, Any] = raw_metrics if isinstance(raw_metrics, dict) else {}
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        stmt = pg_insert(Checkpoint).values(
            job_id=job_id, step=step, path=path, metrics=metrics, created_at=_ts(ev))
        session.execute(stmt.on_conflict_do_update(
            constraint="uq_checkpoints_job_step",
            set_={"path": stmt.excluded.path, "metrics": stmt.excluded.metrics,
                  "created_at": stmt.excluded.created_at}))
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        lite = sqlite_insert(Checkpoint).values(
            job_id=job_id, step=step, path=path, metrics=metrics, created_at=_ts(ev))
        session.execute(lite.on_conflict_do_update(
            index_elements=["job_id", "step"],
            set_={"path": lite.excluded.path, "metrics": lite.excluded.metrics,
                  "created_at": lite.excluded.created_at}))
    else:  # pragma: no cover
        existing = session.scalar(
            select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
        if existing is None:
            session.add(Checkpoint(job_id=job_id, step=step, path=path, metrics=metrics))
        else:
            existing.path, existing.metrics = path, metrics
    retained = ev.get("retained_steps")
    if isinstance(retained, list) and all(isinstance(x, int) for x in retained):
        # save_total_limit deleted older checkpoints: drop their rows, keep this one.
        session.execute(delete(Checkpoint).where(
            Checkpoint.job_id == job_id, Checkpoint.step.not_in([*retained, step])))


def _checkpoint_webhook(session: Session, job_id: str, ev: dict[str, Any]) -> None:
    step = _int(ev.get("step"))
    if step is not None:
        metrics = ev.get("metrics")
        outbox.job_checkpoint(session, job_id, step, metrics if isinstance(metrics, dict) else {})


def ingest_events(session: Session, job_id: str, job_dir: Path | str, *,
                  worker_id: str | None = None, attempt: int | None = None,
                  max_events: int = MAX_EVENTS_PER_BATCH) -> int:
    """Move new lines of ``<job_dir>/events.jsonl`` into the DB; returns how many.

    Call inside a transaction (``session_scope``) and commit right after: the rows and the
    new offset must commit together. With ``worker_id``/``attempt`` the offset only moves
    while that worker still holds that attempt of the job, so a worker that lost the job
    writes nothing.
    """
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        return 0
    old_offset = int(job.events_offset or 0)
    jd = JobDir(Path(job_dir))
    batch: list[dict[str, Any]] = []
    new_offset = old_offset
    for pos, ev in read_events(jd.events, old_offset):
        batch.append(ev)
        new_offset = pos
        if len(batch) >= max_events:
            break
    if not batch:
        return 0

    values = _fold(job, batch)
    guard = [Job.id == job_id, Job.events_offset == old_offset]
    if worker_id is not None:
        guard.append(Job.worker_id == worker_id)
    if attempt is not None:
        guard.append(Job.attempt == attempt)
    moved = execute_rowcount(
        session,
        update(Job).where(and_(*guard)).values(events_offset=new_offset, **values)
        .execution_options(synchronize_session=False),
    )
    if moved != 1:
        # Someone else ingested these lines, or this worker lost the job. Write nothing.
        log.info("job %s: events offset moved or job lost; batch not ingested", job_id)
        return 0
    for ev in batch:
        data = {k: v for k, v in ev.items() if k not in ("type", "time")}
        session.add(JobEvent(job_id=job_id, created_at=_ts(ev),
                             type=str(ev.get("type", "log"))[:32], message=event_message(ev),
                             data=data))
        if ev.get("type") == "checkpoint":
            _upsert_checkpoint(session, job_id, jd.root, ev)
            _checkpoint_webhook(session, job_id, ev)
    for n, usage in _attempt_usage(job, batch).items():
        if not usage:
            continue  # a "started" event that names no processes or device: nothing to set
        attempt_reported(session, job_id, n, usage)
        session.execute(update(JobAttempt)
                        .where(JobAttempt.job_id == job_id, JobAttempt.attempt == n)
                        .values(**usage).execution_options(synchronize_session=False))
    session.flush()
    return len(batch)


def heartbeat(session: Session, job_id: str, *, worker_id: str, attempt: int) -> bool:
    """Refresh heartbeat_at; False if this worker no longer holds this attempt."""
    n = execute_rowcount(
        session,
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.attempt == attempt,
               Job.status.in_(jobstate.HELD))
        .values(heartbeat_at=utcnow())
        .execution_options(synchronize_session=False),
    )
    return n == 1


@dataclass(frozen=True)
class Control:
    """What the DB says the running worker should do."""

    held: bool  # this worker still holds this attempt
    status: str | None
    cancel_requested: bool


def read_control(session: Session, job_id: str, *, worker_id: str, attempt: int) -> Control:
    row = session.execute(
        select(Job.status, Job.worker_id, Job.attempt, Job.cancel_requested_at)
        .where(Job.id == job_id)
    ).one_or_none()
    if row is None:
        return Control(held=False, status=None, cancel_requested=False)
    held = row.worker_id == worker_id and row.attempt == attempt and row.status in jobstate.HELD
    cancel = row.cancel_requested_at is not None or row.status == JobStatus.cancelling
    return Control(held=held, status=row.status, cancel_requested=cancel)
