"""Response models of REST API v1 (the request body of POST /v1/jobs is core.spec.JobSpec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    data: list[T]
    has_more: bool = False
    next_cursor: str | None = Field(
        default=None, description="Pass as `after` for the next page; absent on the last page."
    )


class FileObject(BaseModel):
    id: str
    filename: str
    format: str = Field(
        description="jsonl, json (one array of objects), jsonl.gz, json.gz, csv or parquet"
    )
    bytes: int
    rows: int
    columns: list[str]
    sha256: str
    created_at: datetime


class FileDeleted(BaseModel):
    id: str
    deleted: bool = True


class Progress(BaseModel):
    step: int
    total_steps: int | None
    epoch: float | None
    percent: float | None = Field(description="step / total_steps * 100")
    eta_seconds: float | None = Field(description="Estimated from training speed so far.")


class Metrics(BaseModel):
    train_loss: float | None
    eval_loss: float | None
    learning_rate: float | None
    tokens_per_second: float | None
    peak_memory_mb: float | None


class JobError(BaseModel):
    code: str
    message: str


class JobObject(BaseModel):
    id: str
    name: str | None
    status: str = Field(
        description="validating, queued, running, cancelling, succeeded, failed or cancelled"
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any] = Field(description="The spec as submitted (defaults not filled in).")
    progress: Progress
    metrics: Metrics
    checkpoints_count: int
    adapter_available: bool
    attempt: int
    error: JobError | None
    priority: int = 0
    queue: QueueInfo | None = Field(
        default=None, description="While queued: its position and what it waits for."
    )


class EventObject(BaseModel):
    id: int
    created_at: datetime
    type: str
    message: str
    data: dict[str, Any]


class CheckpointObject(BaseModel):
    step: int
    path: str = Field(description="Relative to the job directory.")
    metrics: dict[str, Any]
    created_at: datetime


class LogLines(BaseModel):
    lines: list[str]


class LaunchInfo(BaseModel):
    accelerate_yaml: str
    argv: list[str]
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables the worker added to the launcher's environment (e.g. "
        "ACCELERATE_USE_CPU, OMP_NUM_THREADS): set them too to reproduce the run by hand.",
    )


class Readiness(BaseModel):
    status: str = Field(description="ok or unavailable")
    checks: dict[str, str] = Field(description="database and broker: ok, or what is wrong.")


class ErrorDetail(BaseModel):
    param: str | None
    message: str


class ErrorInfo(BaseModel):
    code: str = Field(description="Machine-readable, e.g. not_found, invalid_spec, conflict.")
    message: str
    param: str | None = Field(description="The parameter or spec field at fault, if one is.")
    details: list[ErrorDetail] | None = Field(
        default=None, description="Every problem, when the request has several (422)."
    )


class ErrorBody(BaseModel):
    """Every error the API answers with, whatever its status."""

    error: ErrorInfo


class QueueInfo(BaseModel):
    position: int = Field(description="Queued jobs ahead of this one (priority, then age).")
    waiting_for: str = Field(
        description="worker (none registered can run it), gpus, tenant_limit, priority, or "
        "dispatch (a worker with room is about to start it)"
    )
    message: str


class WorkerGpu(BaseModel):
    index: int
    name: str
    memory_mb: int
    job_id: str | None = Field(description="The running job holding it, if any.")


class WorkerObject(BaseModel):
    id: str
    host: str
    executor: str
    state: str = Field(description="active, draining or lost")
    gpus: list[WorkerGpu]
    cpu_cores: int
    capabilities: dict[str, Any]
    slots: int
    running_jobs: list[str]
    started_at: datetime
    heartbeat_at: datetime
