"""One settings object for every process (API, worker, CLI), read once from the environment.

Every variable is prefixed ``FTUNE_`` except the two URLs operators expect by their usual
names (``DATABASE_URL``, ``BROKER_URL``). The defaults are the embedded single-machine
setup: SQLite and kombu's filesystem broker under ``FTUNE_DATA_DIR``.

One cohesive thing, longer than a module usually is here: every setting, its description
and its check, in one class an operator reads top to bottom.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.infra.serving_settings import ServingSettings
from core.spec import Tracker
from core.spec.catalog import CatalogModel, check_ids

# What a SLURM partition, account or QOS name may be: it is written into the batch script.
SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class EvalEndpointEntry(BaseModel):
    """One served model of FTUNE_EVAL_ENDPOINTS."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(pattern=r"^https?://", description="The endpoint's …/v1 URL.")
    model: str | None = Field(default=None, description="The engine's name for the model "
                              "(default: the ftune name).")


class Settings(BaseSettings, ServingSettings):
    """Every setting; the serving ones (FTUNE_ENGINE_VENV, FTUNE_SERVING_*) are declared in
    core/infra/serving_settings.py."""

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
        "last longer than it; see worker/queue/celery_app.py).",
    )

    # Where models and datasets may be read from by path. Anything else is refused.
    # Colon-separated in the environment, like PATH.
    allowed_model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    allowed_data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    allow_hub_models: bool = Field(
        default=True, description="Accept hub ids (org/name) as model.name_or_path."
    )
    hub_check: bool = Field(
        default=True,
        description="Before accepting (API) or launching (worker) a hub id that is not in the "
        "local hub cache, check within seconds that the hub is reachable (core/infra/hub.py), and "
        "refuse with what to do if not. Off where the API's network differs from the workers'.",
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
    max_attempts: int = Field(
        default=3, ge=1,
        description="Runs per job before worker_lost (runs that ended in a pause do not count).",
    )
    cancel_grace_seconds: float = Field(
        default=30.0, ge=0, description="Time the trainer gets to save and exit after SIGTERM."
    )
    default_timeout_seconds: int | None = Field(default=None, gt=0)
    jobs_per_minute_per_tenant: int = Field(default=60, ge=1)
    inference_requests_per_minute_per_key: int = Field(
        default=600, ge=0,
        description="Chat and completion requests one API key may send a minute (a 429 with "
        "Retry-After beyond it, which OpenAI's SDKs retry); 0: no limit.",
    )
    inference_tokens_per_minute_per_key: int = Field(
        default=0, ge=0,
        description="Prompt + completion tokens one API key's inference may use a minute: "
        "once its answers used them, its next request waits for the next minute; 0: no "
        "limit.",
    )
    api_key_cache_seconds: float = Field(
        default=10.0,
        ge=0,
        le=60,
        description="How long the API trusts a key it verified without reading the database "
        "again: a revoked key keeps working on each API process for at most this long. "
        "0: every request reads its key.",
    )
    job_read_cache_seconds: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description="How long the API may serve a GET /v1/jobs/{id} response again from "
        "memory, and only while no write has been committed to the database since it was "
        "read (SQLite's data_version; PostgreSQL's commit notices, api/readcache.py). What "
        "the job shows moves with the clock alone only in its ETA and the usage of a "
        "running attempt: those are at most this old. 0: every request reads the job.",
    )
    queue_snapshot_seconds: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="How old a queued job's position and reason to wait may be: each API "
        "process reads the scheduler's view of the queue at most this often (a job queued "
        "since is never shown from an older view). 0: every read loads it.",
    )

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
    worker_nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="CPU priority (nice value) the worker lowers itself to at start; every "
        "launcher and trainer it starts inherits it. On a machine where the API runs beside "
        "the worker (`ftune up` sets 10), a trainer that keeps every core busy then yields "
        "them to the API's requests instead of taking half of the CPU. 0: unchanged.",
    )
    worker_pin_cpus: bool = Field(
        default=True,
        description="On a CPU worker, pin each job to its slot's own cores (the cores this "
        "worker may use, split evenly between its slots), so that jobs side by side never run "
        "on the same core. Either way each rank gets OMP_NUM_THREADS = its share of the slot's "
        "cores. Off: the kernel places the threads anywhere.",
    )

    # Admission and the queue (core/policy/fleet.py, core/jobs/scheduler.py).
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

    # Webhooks (core/webhooks/): who may be called, and how hard the sender tries.
    webhook_allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated CIDRs webhook URLs may resolve to although they are "
        "private, loopback, link-local or reserved (e.g. 127.0.0.1/32 for a local receiver). "
        "Default none: only public addresses are called.",
    )
    webhook_allow_http: bool = Field(
        default=False, description="Accept http:// webhook URLs (default: https only)."
    )
    webhook_timeout_seconds: float = Field(
        default=10.0, gt=0, le=60, description="Whole-request limit of one delivery attempt."
    )
    webhook_max_response_bytes: int = Field(
        default=64 * 1024, gt=0, description="Read at most this much of a receiver's answer."
    )
    webhook_retry_base_seconds: float = Field(
        default=5.0, gt=0, description="Wait after the first failed attempt; doubles each time."
    )
    webhook_retry_max_interval_seconds: float = Field(
        default=3600.0, gt=0, description="Longest wait between two attempts."
    )
    webhook_retry_window_seconds: float = Field(
        default=3 * 86400.0, gt=0,
        description="A delivery still failing this long after its event is marked failed.",
    )
    webhook_poll_seconds: float = Field(
        default=1.0, gt=0, description="How often the sender looks for due deliveries."
    )
    webhook_lease_seconds: float = Field(
        default=60.0, gt=0,
        description="How long a sender holds a claimed delivery; then another may take it.",
    )
    webhook_max_endpoints_per_tenant: int = Field(default=20, ge=1)
    webhook_retention_days: float = Field(
        default=30.0, gt=0,
        description="Events (and their deliveries) older than this, with nothing left to "
        "retry, are deleted by the sender.",
    )
    webhook_sender_in_worker: bool = Field(
        default=True,
        description="Run the webhook sender as a thread in every worker (off when a separate "
        "`ftune webhooks` process sends).",
    )

    # Retention of finished jobs' history (worker/upkeep/retention.py; docs/operations-
    # retention.md). None keeps it forever. The job row, its usage and checkpoint metrics stay.
    retention_events_days: float | None = Field(
        default=None, gt=0,
        description="Delete the events (job_events rows and events.jsonl) of jobs finished "
        "longer ago than this.",
    )
    retention_logs_days: float | None = Field(
        default=None, gt=0,
        description="Delete the trainer log (trainer.log) of jobs finished longer ago than this.",
    )
    retention_artifacts_days: float | None = Field(
        default=None, gt=0,
        description="Delete the checkpoints and the final adapter or model of jobs finished "
        "longer ago than this (kept while an unfinished job continues from them).",
    )
    retention_batch_rows: int = Field(
        default=1000, ge=1, le=100_000,
        description="Rows deleted per transaction: each commits on its own, so the API's "
        "writes never wait long behind retention.",
    )
    retention_interval_seconds: float = Field(
        default=3600.0, gt=0, description="How often each worker applies the retention.",
    )

    # Graders of training.objective grpo and /v1/graders (core/graders/).
    python_graders: bool = Field(
        default=False,
        description="Allow python graders (user code, run in a bubblewrap sandbox: no "
        "network, no files but its own, CPU/memory/file/process limits). Off by default.",
    )
    python_grader_wall_seconds: float = Field(
        default=10.0, gt=0, le=300, description="Wall-clock budget of one python grader call."
    )
    python_grader_cpu_seconds: int = Field(
        default=5, ge=1, le=300, description="CPU seconds of one python grader call."
    )
    python_grader_memory_mb: int = Field(
        default=1024, ge=64, description="Address space of a python grader's process (MiB)."
    )
    python_grader_processes: int = Field(
        default=16, ge=1, le=4096, description="Processes a python grader's sandbox may run."
    )
    grader_judge_url: str | None = Field(
        default=None,
        description="OpenAI-compatible chat endpoint (…/v1) that score_model graders call; "
        "unset: score_model graders are refused.",
    )
    grader_judge_api_key: str | None = Field(
        default=None, repr=False, description="Bearer token for the judge endpoint."
    )
    grader_judge_allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated CIDRs the judge URL may resolve to although private or "
        "loopback (a judge served inside the cluster); default: public addresses only.",
    )
    grader_judge_allow_http: bool = Field(
        default=False, description="Accept an http:// judge URL (default: https only)."
    )
    grader_judge_timeout_seconds: float = Field(
        default=60.0, gt=0, le=600, description="Whole-request limit of one judge call."
    )
    grader_max_failure_ratio: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="A GRPO job fails grader_failed once more than this share of a grader's "
        "calls (after the first 32) raised or returned a reward outside [0, 1].",
    )
    grpo_no_signal_steps: int | None = Field(
        default=None,
        ge=0,
        description="A GRPO job whose rewards have no spread within any group of answers for "
        "its first this many steps stops and fails no_reward_signal; unset: 10% of the run's "
        "steps, at least 3; 0: never.",
    )

    # Usage and cost (core/jobs/usage.py).
    price_per_gpu_hour: float | None = Field(
        default=None,
        ge=0,
        description="Operator price of one GPU-hour (a CPU process-hour on CPU workers): "
        "turns a job's GPU-seconds into cost. Unset: no cost is shown.",
    )
    dry_run_max_rows: int = Field(
        default=200_000,
        gt=0,
        description="Most data rows (training + evaluation) a dry run tokenizes in the API "
        "process; larger data gets no token count there (`ftune estimate` counts locally).",
    )
    price_currency: str = Field(
        default="USD", min_length=1, max_length=8, description="Currency of the price."
    )

    # Experiment tracking (core/policy/tracking.py). A spec asks for trackers by name; where
    # they write is decided here, so a tenant cannot send metrics to a server of its choice.
    tracking_allowed: Annotated[list[Tracker], NoDecode] = Field(
        default_factory=lambda: list[Tracker](["tensorboard"]),
        description="Trackers a spec may ask for in tracking.report_to, comma-separated: "
        "tensorboard (event files in the job directory), mlflow, wandb.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="Where MLflow runs go (http(s)://server, or a sqlite:/// or file store "
        "on a disk every worker shares). Required when mlflow is in tracking_allowed.",
    )
    mlflow_allowed_tracking_uris: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Other tracking URIs a spec may choose in tracking.mlflow_tracking_uri, "
        "comma-separated, matched exactly. Default: none (the operator's URI only).",
    )
    mlflow_artifact_location: str | None = Field(
        default=None,
        description="Where a new MLflow experiment keeps its artifacts (the adapters). Set it "
        "with a sqlite:/// or file store: their default is ./mlruns under the trainer's "
        "working directory. A tracking server stores them itself.",
    )
    mlflow_experiment_name: str = Field(
        default="ftune",
        min_length=1,
        description="Runs go into the MLflow experiment <name>/<tenant id>: one per tenant, "
        "so the server's experiment permissions can keep tenants apart.",
    )
    mlflow_ui_url: str | None = Field(
        default=None,
        description="Base URL of the MLflow UI for the run links on the job object; default: "
        "the tracking URI when it is http(s), else no link.",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        default="offline",
        description="offline: W&B runs are written into the job directory (upload later with "
        "`wandb sync`); online: sent to W&B (WANDB_API_KEY in the worker's environment).",
    )
    wandb_project: str = Field(default="ftune", min_length=1, description="W&B project.")
    wandb_entity: str | None = Field(default=None, description="W&B entity (team or user).")
    wandb_base_url: str | None = Field(
        default=None, description="A self-hosted W&B server; default: W&B's cloud."
    )

    # The OpenAI face (api/openai/): base models by id, as `model` names them.
    model_catalog: dict[str, CatalogModel] = Field(
        default_factory=dict,
        description='JSON object id -> base model, e.g. {"llama-3.1-8b": {"location": '
        '"/models/Llama-3.1-8B-Instruct", "gpus": 1}} (core/spec/catalog.py has every field). '
        "GET /v1/models lists them; an OpenAI-style job names one as `model`.",
    )

    # Eval runs (core/evals/): where a completions run's model answers, and how hard.
    eval_endpoints: dict[str, EvalEndpointEntry] = Field(
        default_factory=dict,
        description='JSON object: model name -> {"base_url": "http://host:8000/v1", '
        '"model": "<the engine\'s name>"}: engines ftune does not run (a GPU box\'s own '
        "vLLM, a hosted model) that completions runs of every tenant may name; every other "
        "model answers through ftune's deployments (core/evals/endpoint.py).",
    )
    eval_endpoint_api_key: str | None = Field(
        default=None, repr=False, description="Bearer token for the eval endpoints.")
    eval_concurrency: int = Field(
        default=8, ge=1, le=256, description="Requests a run has in flight at once.")
    eval_request_timeout_seconds: float = Field(
        default=120.0, gt=0, le=3600, description="Whole-request limit of one generation.")
    eval_heartbeat_seconds: float = Field(
        default=5.0, gt=0, le=600, description="How often a running eval run says it lives.")
    eval_stale_seconds: float = Field(
        default=60.0, gt=0, description="A running eval run whose worker has not heart-beaten "
        "for this long is taken over by the next worker (it resumes where it stopped).")

    # SLURM executor (README "Running on a SLURM cluster"). No partition: no SLURM pool, and
    # multi-machine specs are refused at submit.
    slurm_partition: str | None = Field(
        default=None, description="Partition this worker submits to; set: a SLURM worker."
    )
    slurm_accounts: dict[str, str] = Field(
        default_factory=dict,
        description="JSON object tenant id -> SLURM account (--account); a tenant not listed "
        "submits without --account (the cluster's default for the worker's user).",
    )
    slurm_qos: str | None = Field(default=None, description="--qos for every job.")
    slurm_default_time_minutes: int = Field(
        default=24 * 60, ge=1, description="--time of a job without resources.timeout_seconds."
    )
    slurm_shared_root: Path | None = Field(
        default=None,
        description="Directory on the filesystem every node mounts at the same path; job "
        "directories of SLURM jobs live under it. Default: <data_dir>/jobs (must be shared).",
    )
    slurm_rank_python: str | None = Field(
        default=None,
        description="Python on the nodes that has ftune's trainer (a venv's bin/python); "
        "default: the worker's own interpreter path.",
    )
    slurm_rank_prefix: list[str] = Field(
        default_factory=list,
        description='JSON list: argv run before the rank command on each node, e.g. '
        '["apptainer", "exec", "--bind", "/shared", "/images/ftune.sif"].',
    )
    slurm_single_node: bool = Field(
        default=False, description="Also send single-machine jobs to SLURM (else they run here)."
    )
    slurm_max_nodes: int = Field(default=1, ge=1, description="Nodes one job may take.")
    slurm_gpus_per_node: int = Field(default=0, ge=0, description="GPUs of a partition node.")
    slurm_cpus_per_node: int = Field(default=1, ge=1, description="CPUs of a partition node.")
    slurm_poll_seconds: float = Field(default=2.0, gt=0, description="squeue poll interval.")
    slurm_submit_retry_seconds: float = Field(
        default=600.0, ge=0,
        description="How long a submit retries, with backoff, while the SLURM controller "
        "does not answer, before the job fails with slurm_unavailable.")

    # Bootstrap key for the embedded setup and tests (hashed into the DB on start).
    bootstrap_api_key: str | None = Field(default=None, repr=False)

    log_level: str = "INFO"

    @field_validator("allowed_model_roots", "allowed_data_roots", mode="before")
    @classmethod
    def _split_paths(cls, v: object) -> object:
        if isinstance(v, str):
            return [p for p in v.split(":") if p]
        return v

    @field_validator("webhook_allowed_networks", "grader_judge_allowed_networks", mode="before")
    @classmethod
    def _split_networks(cls, v: object) -> object:
        if isinstance(v, str):
            return [n.strip() for n in v.split(",") if n.strip()]
        return v

    @field_validator("model_catalog")
    @classmethod
    def _catalog_ids(cls, v: dict[str, CatalogModel]) -> dict[str, CatalogModel]:
        return check_ids(v)

    @field_validator("webhook_allowed_networks", "grader_judge_allowed_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        import ipaddress

        for n in v:
            try:
                ipaddress.ip_network(n, strict=False)
            except ValueError as e:
                raise ValueError(f"FTUNE_WEBHOOK_ALLOWED_NETWORKS: {e}") from None
        return v

    @field_validator("tracking_allowed", "mlflow_allowed_tracking_uris", mode="before")
    @classmethod
    def _split_commas(cls, v: object) -> object:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("slurm_partition", "slurm_qos")
    @classmethod
    def _slurm_name(cls, v: str | None) -> str | None:
        if v is not None and not SLURM_NAME.fullmatch(v):
            raise ValueError("must be letters, digits, '_', '-' or '.'")
        return v

    @field_validator("slurm_accounts")
    @classmethod
    def _slurm_accounts(cls, v: dict[str, str]) -> dict[str, str]:
        bad = sorted(a for a in v.values() if not SLURM_NAME.fullmatch(a))
        if bad:
            raise ValueError(f"accounts must be letters, digits, '_', '-' or '.': {bad}")
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
        if self.webhook_lease_seconds <= self.webhook_timeout_seconds:
            raise ValueError("FTUNE_WEBHOOK_LEASE_SECONDS must exceed FTUNE_WEBHOOK_TIMEOUT_SECONDS: "
                             "a claim must outlast the attempt it covers")
        if "mlflow" in self.tracking_allowed and not self.mlflow_tracking_uri:
            raise ValueError("FTUNE_TRACKING_ALLOWED has mlflow: set FTUNE_MLFLOW_TRACKING_URI")
        if self.bootstrap_api_key is not None and len(self.bootstrap_api_key) < 16:
            raise ValueError("FTUNE_BOOTSTRAP_API_KEY must be at least 16 characters")
        return self

    @property
    def decompressed_limit(self) -> int:
        """max_decompressed_bytes, or its default."""
        return self.max_decompressed_bytes or 8 * self.max_upload_bytes

    @property
    def slurm_enabled(self) -> bool:
        return self.slurm_partition is not None

    @property
    def slurm_jobs_dir(self) -> Path:
        return (self.slurm_shared_root or self.jobs_dir).expanduser().resolve()

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
