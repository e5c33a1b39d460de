"""Database models. The database is the source of truth for every job.

One cohesive thing, longer than a module usually is here: the schema, every table one after
the other with the column types and defaults they share, as a reader checks it against the
migrations. Every schema change is an Alembic migration (migrations/versions); tests build
the schema with ``alembic upgrade head``, never with ``create_all``.
"""

from __future__ import annotations

import secrets
from datetime import UTC, date, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

JSONType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class JobStatus(StrEnum):
    # In the v1 contract (the list filter, /metrics) but never stored: POST /v1/jobs
    # validates before it records a job, which starts queued; core/jobs/state.py has no move
    # into or out of it.
    validating = "validating"
    queued = "queued"
    running = "running"
    cancelling = "cancelling"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    # A pause: the worker stops the run at a checkpoint (pausing), then the job waits,
    # holding no worker, until it is resumed (paused -> queued).
    pausing = "pausing"
    paused = "paused"


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    """Only a SHA-256 of the key is stored; the key is shown once, when created.

    Keys are long random strings, so a fast hash is enough (no dictionary to attack);
    ``prefix`` is the public first characters, for listing keys without revealing them."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # "tenant": the tenant's own files and jobs; "admin": also the fleet (GET /v1/workers).
    role: Mapped[str] = mapped_column(String(16), default="tenant", server_default="tenant")


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    # jsonl | json (one array) | jsonl.gz | json.gz | csv | parquet
    format: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(BigInteger)
    columns: Mapped[list[str]] = mapped_column(JSONType, default=list)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The data format detected at upload (core.data.formats.detect.detect_upload); None for
    # files uploaded before it was recorded.
    detected: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # fine-tune (a dataset) or evals (an eval's items: rows {"item": {...}, "sample"?: {...}}).
    purpose: Mapped[str] = mapped_column(String(32), default="fine-tune",
                                         server_default="fine-tune")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        # A list filtered by status reads only its page (GET /v1/jobs?status=).
        Index("ix_jobs_tenant_status_created", "tenant_id", "status", "created_at", "id"),
        # GET /v1/models: the tenant's succeeded jobs, latest finished first (read in order,
        # not sorted: the tenant's whole history sorted was ~1 s at 100,000 jobs).
        Index("ix_jobs_tenant_status_finished", "tenant_id", "status", "finished_at"),
        # Jobs of a status (held, running) and the oldest queued one (/metrics) by a probe.
        Index("ix_jobs_status_queued_at", "status", "queued_at"),
        # /metrics reads the last hour of finished jobs at every scrape.
        Index("ix_jobs_finished_at", "finished_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.queued)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # Higher runs first; FIFO (created_at) within a priority. Copied from the spec.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Last time the job was (re-)enqueued; the reconciler bumps it when it sends again.
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    # Which worker holds the job, and how many times it was started (resume count + 1).
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts that ended in a pause the user asked for: they are not failures, so they do
    # not count against max_attempts (which limits attempt - pauses).
    pauses: Mapped[int] = mapped_column(Integer, default=0)
    # When it was last paused, and the seconds it spent paused after it first started: the
    # time limit (timeout_seconds, counted from started_at) leaves that time out.
    paused_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    paused_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    job_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    events_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    launch: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # Why an executor that queues jobs itself (SLURM) has not started this one yet.
    waiting_for: Mapped[str | None] = mapped_column(Text, nullable=True)

    # Progress and latest metrics, denormalised from events for cheap polling.
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    epoch: Mapped[float | None] = mapped_column(Float, nullable=True)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    eval_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    learning_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_second: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_memory_mb: Mapped[float | None] = mapped_column(Float, nullable=True)
    memory: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # Preference objectives: latest reward_chosen/rejected/margin/accuracy (and kl).
    preference_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    training_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The trainer's latest "phase" event of this attempt (before the first step), or
    # {"phase": "training"} once it started: what the job object's `phase` says.
    phase: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # The trainer's "tracking" event: {tracker: {run_id, url, ...}} (core/train/tracking.py).
    tracking: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)

    adapter_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)

    # The body as sent (``spec`` above is the validated request, defaults unset, which the
    # worker runs), and the spec that ran: every default filled at submit, then what only
    # the trainer knows (resolved target modules) when it starts; ``run_info`` is where and
    # how it ran (total steps, world size, device, worker). Null for jobs from before 0003.
    request: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    resolved_spec: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    run_info: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # What submit read from the training data (core/data/formats Receipt): format, columns
    # used and ignored. Null for jobs from before 0011.
    data_receipt: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # A job created through the OpenAI face (api/openai/): the model id, files, suffix,
    # metadata, integrations and the hyperparameters as asked and as resolved. Null for
    # jobs created with a JobSpec (the face derives their view from the spec).
    openai: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # When its owner deleted the trained model (OpenAI's models.delete): its names are then
    # unknown to inference and GET /v1/models; the job itself stays (core/serving/).
    model_deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The spec's evaluation as it ran (core/evals/job_evaluation.py): each model's scores,
    # the best checkpoint chosen (then the job's result), or why it could not run.
    evaluation: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)


# The scheduler reads the first queued jobs in queue order (core/jobs/queue_load.py): in the
# index's own order, so a deep queue costs a decision only its window, not a sort of the queue.
Index("ix_jobs_queue", Job.status, Job.priority.desc(), Job.created_at, Job.id)


class JobStatusCount(Base):
    """How many jobs are in each status, kept by the state machine in the transaction of
    each move (core/jobs/state.py, where the shard rule and its reasons are), so /metrics
    reads these few rows instead of counting the history. ``shard``: the last character of
    the counted jobs' ids; each row is the exact count of its shard's jobs in ``status``."""

    __tablename__ = "job_status_counts"

    status: Mapped[str] = mapped_column(String(16), primary_key=True)
    shard: Mapped[str] = mapped_column(String(1), primary_key=True)
    jobs: Mapped[int] = mapped_column(BigInteger, default=0)


class JobAttempt(Base):
    """One run of a job on a worker: what it used (core/jobs/usage.py sums these).

    Opened by the claim, closed by the move that ends the attempt (core/jobs/state.py);
    ``tokens``/``loss_tokens`` are what this attempt trained (a resumed attempt counts the
    steps it redoes again: they ran again)."""

    __tablename__ = "job_attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", name="uq_job_attempts_job_attempt"),
        Index("ix_job_attempts_ended_at", "ended_at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Trainer processes (ranks): each holds a GPU, or a CPU process on a CPU worker.
    processes: Mapped[int] = mapped_column(Integer)
    device: Mapped[str | None] = mapped_column(String(16), nullable=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    loss_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class UsageDay(Base):
    """Ended attempts of a tenant summed per UTC day they ended, kept as attempts end
    (core/jobs/usage.py): GET /v1/usage and /metrics read these rows, not the attempts, so
    they cost the days asked for whatever the history. ``jobs``: jobs with an attempt that
    ended that day."""

    __tablename__ = "usage_days"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    day: Mapped[date] = mapped_column(Date(), primary_key=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    jobs: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    loss_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    wall_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)


class UsageTotal(Base):
    """A tenant's ended attempts summed over all time, kept with its day rows (the same
    upsert's transaction, core/jobs/usage.py): /metrics' usage counters read one row a
    tenant, not every day of the history."""

    __tablename__ = "usage_totals"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    loss_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    wall_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)


class JobMetadata(Base):
    """A job's OpenAI ``metadata`` pairs (jobs.openai keeps them as sent), one row each, so
    that GET /v1/fine_tuning/jobs?metadata[k]=v reads an index in list order
    (api/openai/listing.py) instead of every job of the tenant."""

    __tablename__ = "job_metadata"
    __table_args__ = (
        Index("ix_job_metadata_lookup", "tenant_id", "key", "value", "created_at", "job_id"),
    )

    job_id: Mapped[str] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    value: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())  # the job's


class RetentionMark(Base):
    """How far retention got, per kind of history (events, logs, artifacts): every job that
    finished before (finished_at, job_id) has had that kind pruned (worker/upkeep/
    retention.py), so each run reads only the jobs finished since."""

    __tablename__ = "retention_marks"

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime())
    job_id: Mapped[str] = mapped_column(String(40))


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    type: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class WebhookEndpoint(Base):
    """A tenant's webhook receiver. The secret is kept as issued: every delivery is signed
    with it (HMAC), so a hash would not do; it is shown to the tenant once, at creation."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("wh"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(Text)
    description: Mapped[str] = mapped_column(String(500), default="")
    event_types: Mapped[list[str]] = mapped_column(JSONType, default=list)
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class WebhookEvent(Base):
    """The outbox: one row per event, written in the transaction that made it happen. Its
    id is the ``webhook-id`` header of every delivery and retry, so receivers de-duplicate."""

    __tablename__ = "webhook_events"
    # The sender prunes old events by age.
    __table_args__ = (Index("ix_webhook_events_created_at", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("msg"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class DeliveryStatus(StrEnum):
    pending = "pending"
    delivered = "delivered"
    failed = "failed"  # the retry window ran out


class WebhookDelivery(Base):
    """One event to one endpoint: what the sender claims, retries and records."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # The sender's claim: pending rows by due time.
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "id"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    event_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_events.id", ondelete="CASCADE"), index=True
    )
    endpoint_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE")
    )
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # A sender's claim: who holds the row, until when (another may take it after).
    lease_owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class WorkerState(StrEnum):
    active = "active"  # takes new jobs
    draining = "draining"  # an admin asked it to take no new job; running ones finish
    lost = "lost"  # stopped heart-beating (the reconciler says so)
    stopped = "stopped"  # shut down cleanly (SIGTERM, Ctrl-C): not lost, just gone


# States of a worker that runs nothing and counts for nothing until it registers again.
WORKER_GONE = (WorkerState.lost, WorkerState.stopped)


class Worker(Base):
    """A worker process and what it can run: its inventory, heart-beaten into the DB
    (worker/upkeep/registry.py). The API admits only what some active worker could run, and the
    scheduler (core/jobs/scheduler.py) places jobs on a worker's free GPUs / slots."""

    __tablename__ = "workers"
    # Those seen lately, by range: a row stays for every worker process there ever was.
    __table_args__ = (Index("ix_workers_heartbeat_at", "heartbeat_at"),)

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    # "local": jobs run on this host's GPUs; a pool executor (e.g. SLURM) registers its own.
    executor: Mapped[str] = mapped_column(String(32), default="local")
    # [{"index": 0, "name": "H100", "memory_mb": 81559}, ...]; [] on a CPU worker.
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSONType, default=list)
    cpu_cores: Mapped[int] = mapped_column(Integer, default=1)
    # {"cuda": bool, "bf16": bool, "flash_attn": bool, "cpu_fsdp2": bool, "max_machines": int}
    capabilities: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    slots: Mapped[int] = mapped_column(Integer, default=1)
    state: Mapped[str] = mapped_column(String(16), default=WorkerState.active)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class GpuAllocation(Base):
    """A GPU (or CPU slot, ``gpu_index`` < 0) of a worker held by a running job, or a GPU held
    by a deployment (``deployment_id``, core/serving/placement.py; a job's then None). The
    primary key is the guarantee that no GPU is ever handed to two of them: a second claim
    of the same (worker, index) fails its INSERT and rolls back its claim. A job's rows are
    deleted when it leaves running/cancelling (core/jobs/state.py), whoever moves it; a
    deployment's when it stops."""

    __tablename__ = "gpu_allocations"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), index=True, nullable=True)
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    deployment_id: Mapped[str | None] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE", name="fk_gpu_allocations_deployment_id"),
        index=True, nullable=True)
    allocated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RateWindow(Base):
    """Inference requests and tokens of one API key in one minute (api/services/rate_limits.py).
    Not in 0014's commit notices: a counter written at every inference request must not wake
    every API process's read cache."""

    __tablename__ = "rate_windows"

    subject: Mapped[str] = mapped_column(String(48), primary_key=True)  # key:<hash>
    window: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # minutes since epoch
    requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class SchedulerLock(Base):
    """One row. Every scheduling decision starts by updating it: a row lock on PostgreSQL
    and the write lock on SQLite, so decisions (priority, tenant limits, reservations) are
    made one at a time against the state the previous one committed."""

    __tablename__ = "scheduler_lock"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    decisions: Mapped[int] = mapped_column(BigInteger, default=0)


class Eval(Base):
    """An evaluation (OpenAI's Evals API): the item schema and the testing criteria that
    every run of it grades with (core/evals/spec.py holds their shapes)."""

    __tablename__ = "evals"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("eval"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    meta: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    data_source_config: Mapped[dict[str, Any]] = mapped_column(JSONType)
    testing_criteria: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class EvalRun(Base):
    """One run of an eval over a data source: queued in the DB, claimed by a worker with a
    guarded UPDATE (core/evals/store.py), its output items written as each is graded so
    that a run taken over after its worker died resumes where it stopped."""

    __tablename__ = "eval_runs"
    __table_args__ = (Index("ix_eval_runs_eval_created", "eval_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("evalrun"))
    eval_id: Mapped[str] = mapped_column(ForeignKey("evals.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    meta: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    model: Mapped[str] = mapped_column(String(256), default="")
    data_source: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # queued -> in_progress -> completed | failed | canceled; canceling while a cancel of a
    # running run is being enforced.
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    items_total: Mapped[int] = mapped_column(Integer, default=0)
    # Written when the run ends (also kept while it runs: counted from its output items).
    result_counts: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    per_testing_criteria_results: Mapped[list[dict[str, Any]] | None] = mapped_column(
        JSONType, nullable=True)
    per_model_usage: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)
    # Seconds spent generating and grading, over all attempts (the bench's shares).
    generation_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    grading_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # The job whose evaluation made this run (its checkpoints are served to it before the
    # job succeeded); null for the runs users create.
    job_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)


class EvalOutputItem(Base):
    """One data source item of a run: its sample (the model's answer, or the given one) and
    each testing criterion's result. Unique per (run, item): a resumed run skips the items
    it already has."""

    __tablename__ = "eval_output_items"
    __table_args__ = (UniqueConstraint("run_id", "datasource_item_id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True,
                                    default=lambda: new_id("outputitem"))
    run_id: Mapped[str] = mapped_column(ForeignKey("eval_runs.id", ondelete="CASCADE"))
    eval_id: Mapped[str] = mapped_column(String(40))
    datasource_item_id: Mapped[int] = mapped_column(Integer)
    datasource_item: Mapped[dict[str, Any]] = mapped_column(JSONType)
    status: Mapped[str] = mapped_column(String(8))  # pass | fail | error
    results: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    sample: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
