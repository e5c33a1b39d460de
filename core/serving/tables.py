"""The serving tables: deployments (one engine server each), the adapters loaded into each,
and the tokens inference used per tenant, model and day."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from core.db.models import Base, UTCDateTime, new_id, utcnow


class DeploymentState(StrEnum):
    requested = "requested"  # a request wants it; no worker runs it yet
    starting = "starting"  # a worker launched the engine; not healthy yet
    ready = "ready"  # healthy: requests go to ``url``
    stopping = "stopping"  # asked to stop (the operator; DELETE of a full model)
    stopped = "stopped"  # not running (idle, stopped, or its worker went away)
    failed = "failed"  # died more often than the restart budget allows


RUNNING = (DeploymentState.starting, DeploymentState.ready)


class Deployment(Base):
    """One engine server (vLLM's OpenAI server): a base model serving every tenant's adapters
    on it, or a full fine-tune's own model. ``key`` says which, and is unique: at most one
    deployment of a model exists, whatever its state."""

    __tablename__ = "deployments"
    __table_args__ = (Index("ix_deployments_state", "state"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("dep"))
    key: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # base | full
    location: Mapped[str] = mapped_column(Text)  # what --model loads
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True)
    keep_warm: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[str] = mapped_column(String(16), default=DeploymentState.requested)
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    url: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The engine's bearer token (VLLM_API_KEY), new at each start: only ftune reaches it.
    engine_key: Mapped[str | None] = mapped_column(String(80), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Counts the engine's starts; an adapter row of an older generation is not loaded.
    generation: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    memory_mb: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Why a requested deployment is not placed yet (core/serving/placement.py), else None.
    waiting: Mapped[str | None] = mapped_column(Text, nullable=True)
    requested_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    ready_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class DeploymentAdapter(Base):
    """An adapter loaded into a deployment's engine (its generation), by its engine name."""

    __tablename__ = "deployment_adapters"

    deployment_id: Mapped[str] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    generation: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    loaded_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class InferenceUsage(Base):
    """Tokens a tenant's inference requests used, per model name (as the tenant wrote it)
    and UTC day."""

    __tablename__ = "inference_usage"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # YYYY-MM-DD
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
