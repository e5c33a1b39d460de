"""One settings object for every process (API, worker, CLI), read once from the environment.

Every variable is prefixed ``FTUNE_`` except the two URLs operators expect by their usual
names (``DATABASE_URL``, ``BROKER_URL``). The defaults are the embedded single-machine
setup: SQLite and kombu's filesystem broker under ``FTUNE_DATA_DIR``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FTUNE_", extra="ignore")

    data_dir: Path = Field(
        default=Path("./.ftune"),
        description="Root for the SQLite DB, uploads, job directories and the embedded broker.",
    )
    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "FTUNE_DATABASE_URL"),
        description="SQLAlchemy URL; default sqlite:///<data_dir>/ftune.db.",
    )
    broker_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("BROKER_URL", "FTUNE_BROKER_URL"),
        description="Celery broker URL; default filesystem broker under <data_dir>/broker.",
    )
    queue_name: str = Field(default="ftune.jobs", description="Celery queue GPU workers consume.")
    broker_transport_options: dict[str, Any] = Field(
        default_factory=dict,
        description="JSON object merged over the Celery broker transport options, e.g. "
        '{"visibility_timeout": 3600} for Redis (jobs are acked when received, so a run may '
        "last longer than it; see worker/celery_app.py).",
    )

    # Where models and datasets may be read from by path. Anything else is refused.
    # Colon-separated in the environment, like PATH.
    allowed_model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    allowed_data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    allow_hub_models: bool = Field(
        default=True, description="Accept hub ids (org/name) as model.name_or_path."
    )
    allow_trust_remote_code: bool = Field(
        default=False, description="Operator switch: specs may set trust_remote_code only if on."
    )

    # Upload limits.
    max_upload_bytes: int = Field(default=1 << 30, gt=0)
    max_upload_rows: int = Field(default=10_000_000, gt=0)
    max_decompressed_bytes: int | None = Field(
        default=None,
        gt=0,
        description="What gzip-compressed data (.jsonl.gz, .json.gz) may expand to, in bytes, "
        "at upload and submit; more is refused. Default: 8 x max_upload_bytes.",
    )

    # Job lifecycle.
    heartbeat_seconds: float = Field(default=5.0, gt=0)
    heartbeat_timeout_seconds: float = Field(
        default=60.0, gt=0, description="A running job whose heartbeat is older is lost."
    )
    queued_requeue_seconds: float = Field(
        default=120.0, gt=0, description="A queued job older than this is enqueued again."
    )
    reconcile_interval_seconds: float = Field(default=15.0, gt=0)
    max_attempts: int = Field(default=3, ge=1, description="Runs per job before worker_lost.")
    cancel_grace_seconds: float = Field(
        default=30.0, ge=0, description="Time the trainer gets to save and exit after SIGTERM."
    )
    default_timeout_seconds: int | None = Field(default=None, gt=0)
    jobs_per_minute_per_tenant: int = Field(default=60, ge=1)

    # Worker capabilities.
    worker_gpus: int | None = Field(
        default=None, description="GPUs this worker may use; default: torch.cuda.device_count()."
    )
    worker_id: str | None = None
    cpu_fsdp2: bool = Field(
        default=False,
        description="Operator switch: let a worker without GPUs run FSDP2 jobs, really sharded "
        "over gloo (the trainer proves the sharding or fails). Off: CPU workers refuse FSDP.",
    )
    fake_gpus: Annotated[list[dict[str, Any]] | None, NoDecode] = Field(
        default=None,
        description="Tests and benchmarks only: pretend this worker has these GPUs, a count "
        '("4") or a JSON list ([{"name": "H100", "memory_mb": 81559}, ...]). Jobs get '
        "CUDA_VISIBLE_DEVICES, gpu_ids and ports as on real GPUs; only a fake trainer can run.",
    )
    worker_slots: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Jobs a worker runs at once. Default: one per GPU (each job gets "
        "distributed.num_processes of them), or 1 on a CPU worker; CPU cores are split "
        "evenly between a CPU worker's slots.",
    )

    # Admission and the queue (core/fleet.py).
    queue_unrunnable: bool = Field(
        default=False,
        description="Admit a job no registered worker could run (the fleet is still "
        "starting); it waits and says what for. Off: such a job is a 422 at submit.",
    )
    max_priority: int = Field(
        default=10, ge=-100, le=100, description="Highest spec priority a tenant may use."
    )
    tenant_max_running_jobs: int | None = Field(
        default=None, ge=1, description="Jobs a tenant may have running at once (none: no limit)."
    )
    tenant_max_gpus: int | None = Field(
        default=None, ge=1, description="GPUs a tenant's running jobs may hold at once."
    )
    tenant_limits: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description='Per-tenant overrides by tenant name, JSON: {"acme": {"max_priority": 50, '
        '"max_running_jobs": 8, "max_gpus": 16}}.',
    )
    reserve_after_seconds: float = Field(
        default=300.0,
        ge=0,
        description="A queued job that has waited this long and fits no worker's free GPUs "
        "gets a reservation: the worker with the most free GPUs that could hold it starts "
        "nothing new until it fits (so small jobs cannot starve a large one).",
    )

    trainer_module: str = Field(
        default="core.train",
        description="Module `accelerate launch -m` runs; tests swap in a fake trainer.",
    )

    # Bootstrap key for the embedded setup and tests (hashed into the DB on start).
    bootstrap_api_key: str | None = Field(default=None, repr=False)

    log_level: str = "INFO"

    @field_validator("allowed_model_roots", "allowed_data_roots", mode="before")
    @classmethod
    def _split_paths(cls, v: object) -> object:
        if isinstance(v, str):
            return [p for p in v.split(":") if p]
        return v

    @field_validator("fake_gpus", mode="before")
    @classmethod
    def _gpu_list(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None
            v = int(v) if v.isdigit() else json.loads(v)
        if isinstance(v, int):
            return [{"name": "fake-gpu", "memory_mb": 81559} for _ in range(v)]
        return v

    @field_validator("tenant_limits")
    @classmethod
    def _known_limits(cls, v: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        known = {"max_priority", "max_running_jobs", "max_gpus"}
        for tenant, limits in v.items():
            unknown = set(limits) - known
            if unknown:
                raise ValueError(f"{tenant}: unknown limits {sorted(unknown)}; known: "
                                 f"{sorted(known)}")
        return v

    def tenant_limit(self, tenant_name: str, what: str) -> int | None:
        """A tenant's limit (max_priority, max_running_jobs, max_gpus): its own entry in
        tenant_limits, else the fleet-wide setting."""
        own = self.tenant_limits.get(tenant_name, {})
        if what in own:
            return own[what]
        default: int | None = getattr(self, "max_priority" if what == "max_priority"
                                      else f"tenant_{what}")
        return default

    @field_validator("trainer_module")
    @classmethod
    def _dotted_name(cls, v: str) -> str:
        if not all(part.isidentifier() for part in v.split(".")):
            raise ValueError("must be a dotted module name")
        return v

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        self.allowed_model_roots = [p.expanduser().resolve() for p in self.allowed_model_roots]
        self.allowed_data_roots = [p.expanduser().resolve() for p in self.allowed_data_roots]
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.data_dir / 'ftune.db'}"
        if self.broker_url is None:
            self.broker_url = "filesystem://"
        if self.bootstrap_api_key is not None and len(self.bootstrap_api_key) < 16:
            raise ValueError("FTUNE_BOOTSTRAP_API_KEY must be at least 16 characters")
        return self

    @property
    def decompressed_limit(self) -> int:
        """max_decompressed_bytes, or its default."""
        return self.max_decompressed_bytes or 8 * self.max_upload_bytes

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def broker_dir(self) -> Path:
        return self.data_dir / "broker"

    @property
    def is_sqlite(self) -> bool:
        return str(self.database_url).startswith("sqlite")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def reset_settings_cache() -> None:
    """Tests and the CLI change the environment, then call this."""
    get_settings.cache_clear()
