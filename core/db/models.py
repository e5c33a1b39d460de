"""Database models. The database is the source of truth for every job.

Every schema change is an Alembic migration (migrations/versions); tests build the schema
with ``alembic upgrade head``, never with ``create_all``.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
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
    # validates before it records a job, which starts queued; core/jobstate.py has no move
    # into or out of it.
    validating = "validating"
    queued = "queued"
    running = "running"
    cancelling = "cancelling"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


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


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_jobs_status", "status"),
        # /metrics reads the last hour of finished jobs at every scrape.
        Index("ix_jobs_finished_at", "finished_at"),
        # The scheduler reads queued jobs in queue order (core/fleet.py).
        Index("ix_jobs_queue_order", "status", "priority", "created_at"),
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
    job_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    events_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    launch: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)

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
    training_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    adapter_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)


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


class WorkerState(StrEnum):
    active = "active"  # takes new jobs
    draining = "draining"  # an admin asked it to take no new job; running ones finish
    lost = "lost"  # stopped heart-beating (the reconciler says so)


class Worker(Base):
    """A worker process and what it can run: its inventory, heart-beaten into the DB
    (worker/registry.py). The API admits only what some active worker could run, and the
    scheduler (core/fleet.py) places jobs on a worker's free GPUs / slots."""

    __tablename__ = "workers"

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
    """A GPU (or CPU slot, ``gpu_index`` < 0) of a worker held by a running job. The primary
    key is the guarantee that no GPU is ever handed to two jobs: a second claim of the same
    (worker, index) fails its INSERT and rolls back its claim. Rows are deleted when the job
    leaves running/cancelling (core/jobstate.py), whoever moves it."""

    __tablename__ = "gpu_allocations"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    allocated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class SchedulerLock(Base):
    """One row. Every scheduling decision starts by updating it: a row lock on PostgreSQL
    and the write lock on SQLite, so decisions (priority, tenant limits, reservations) are
    made one at a time against the state the previous one committed."""

    __tablename__ = "scheduler_lock"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    decisions: Mapped[int] = mapped_column(BigInteger, default=0)
