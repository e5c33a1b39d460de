"""Response models of REST API v1 (the request body of POST /v1/jobs is core.spec.JobSpec).

One cohesive thing, longer than a module usually is here: the API's shapes, one after the
other as the routes use them (their JSON Schema is the OpenAPI documentation); the OpenAI
face's own are in api/openai/schemas.py."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from core.evals.job_results import JobEvaluation

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    data: list[T]
    has_more: bool = False
    next_cursor: str | None = Field(
        default=None, description="Pass as `after` for the next page; absent on the last page."
    )


class NearMiss(BaseModel):
    layout: str
    format: str
    missing: list[str] = Field(
        description="The columns it needs that the file lacks; empty: they are there and "
        "hold other shapes."
    )


class DetectedData(BaseModel):
    """The data format an upload holds, read once at upload from its first rows, the way
    a job with dataset.format auto reads them."""

    format: str | None = Field(
        description="The format auto finds among every format (text, prompt_completion, chat, "
        "alpaca, sharegpt, preference, kto, seq2seq, classification), or null where none or "
        "several fit. A job's task and objective may narrow the choice; its receipt (the "
        "job object's data) says what was used."
    )
    layout: str | None = Field(description="The way of storing it (openai_chat, openai_dpo, ...).")
    columns_used: dict[str, str] | None = Field(
        default=None, description="Role -> column, as a job would read them."
    )
    columns_ignored: list[str] | None = None
    message: str | None = Field(default=None, description="Why no format was detected.")
    near_misses: list[NearMiss] | None = Field(
        default=None, description="No format fits: the layouts that came closest."
    )
    candidates: list[str] | None = Field(
        default=None, description="Several formats fit: the layouts (set dataset.format)."
    )


class FileObject(BaseModel):
    """A dataset; OpenAI's file object (object, purpose, status, unix created_at) with ours."""

    object: Literal["file"] = "file"
    id: str
    filename: str
    format: str = Field(
        description="jsonl, json (one array of objects), jsonl.gz, json.gz, csv or parquet"
    )
    bytes: int
    rows: int
    columns: list[str]
    sha256: str
    created_at: int = Field(description="Unix seconds.")
    detected: DetectedData | None = Field(
        default=None, description="The data format the rows hold (null: a results file, or "
        "an upload recorded before detection was)."
    )
    purpose: Literal["fine-tune", "fine-tune-results", "evals"] = Field(
        default="fine-tune", description="fine-tune: an upload; fine-tune-results: a job's "
        "step metrics (its results file); evals: an eval's items."
    )
    status: Literal["processed"] = Field(
        default="processed", description="Always processed: an upload is validated before it "
        "is recorded.")


class FileDeleted(BaseModel):
    object: Literal["file"] = "file"
    id: str
    deleted: bool = True


class Progress(BaseModel):
    step: int
    total_steps: int | None
    epoch: float | None
    percent: float | None = Field(description="step / total_steps * 100")
    eta_seconds: float | None = Field(description="Estimated from training speed so far.")


class JobPhase(BaseModel):
    """What the job is doing, before its first step in particular."""

    phase: str = Field(
        description="queued; starting (the worker launches the trainer), preparing_data "
        "(reading and tokenizing), loading_model (`loaded` of `total` tensors, from `shards` "
        "weight files), preparing_run (wrapping for the strategy; DeepSpeed compiles its "
        "ops), training, evaluating (after training: the spec's evaluation scores its "
        "models). Absent once the job ended."
    )
    message: str = Field(description="The same for a person, e.g. 'loading model: 12 of 24 "
                         "tensors (2 shard files)'.")
    loaded: int | None = None
    total: int | None = None
    shards: int | None = None


class Metrics(BaseModel):
    train_loss: float | None
    eval_loss: float | None
    learning_rate: float | None
    tokens_per_second: float | None
    peak_memory_mb: float | None
    preference: dict[str, float | None] | None = Field(
        default=None,
        description="training.objective dpo, orpo or kto: the latest logged reward_chosen and "
        "reward_rejected (beta x the answer's log-probability ratio to the reference; ORPO: "
        "to nothing), reward_margin (chosen - rejected), reward_accuracy (share of pairs "
        "whose chosen reward is higher) and, for kto, kl. grpo: the grader's mean reward "
        "and reward_std over the sampled answers, completion_length (tokens) and kl (beta > "
        "0). Absent for sft.",
    )


class JobError(BaseModel):
    code: str
    message: str


class Usage(BaseModel):
    """What a job (or a tenant's day) used, summed over attempts (core/jobs/usage.py)."""

    trained_tokens: int = Field(
        description="Non-padding input tokens trained, over all processes and attempts (steps "
        "redone after a resume count again)."
    )
    loss_tokens: int = Field(description="Label tokens that carried a loss (not masked).")
    wall_seconds: float = Field(
        description="Seconds attempts held their worker, claim to end (a running attempt "
        "counts up to now)."
    )
    gpu_seconds: float = Field(
        description="Processes x wall seconds: GPU-seconds, or process-seconds on a CPU worker."
    )
    attempts: int
    cost: float | None = Field(
        description="gpu_seconds priced at FTUNE_PRICE_PER_GPU_HOUR; null when unset."
    )
    currency: str | None


class JobUsage(Usage):
    epochs: float | None = Field(description="Epochs trained, as last reported.")


class MlflowRun(BaseModel):
    run_id: str
    experiment_id: str
    url: str | None = Field(
        default=None, description="The run in the MLflow UI, when the server has one."
    )


class WandbRun(BaseModel):
    run_id: str
    project: str
    entity: str | None = None
    url: str | None = Field(default=None, description="The run on W&B; null for offline runs.")
    mode: str = Field(
        description="online, or offline: the run is kept in the job directory until the "
        "operator runs `wandb sync`."
    )


class TrackingLinks(BaseModel):
    tensorboard: str | None = Field(
        default=None, description="Download URL of the TensorBoard event files (a zip)."
    )
    mlflow: MlflowRun | None = None
    wandb: WandbRun | None = None


class JobObject(BaseModel):
    id: str
    name: str | None
    status: str = Field(
        description="validating, queued, running, cancelling, pausing, paused, succeeded, "
        "failed or cancelled"
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any] = Field(
        description="The spec that runs: every default that applies filled in at submit (a "
        "valid spec: re-submit it to run the same job), and once the trainer has started, "
        "peft.target_modules as peft resolved them."
    )
    request: dict[str, Any] = Field(description="The body as it was sent.")
    data: dict[str, Any] | None = Field(
        default=None,
        description="What was read from the training data at submit: format (detected when "
        "dataset.format is auto), layout, columns_used (role -> column), columns_ignored, "
        "rows.",
    )
    run: dict[str, Any] | None = Field(
        default=None,
        description="How the latest attempt runs, from the trainer's start: total_steps, "
        "num_train_epochs, world_size, strategy, device, worker_id, executor, ...",
    )
    usage: JobUsage
    progress: Progress
    phase: JobPhase | None = Field(
        default=None, description="What a queued or running job is doing now (null once ended)."
    )
    metrics: Metrics
    checkpoints_count: int
    adapter_available: bool
    model_available: bool = Field(
        default=False,
        description="A full fine-tune (peft method full) succeeded: GET /v1/jobs/{id}/model "
        "lists the model's files (adapter_available stays false).",
    )
    attempt: int
    pauses: int = Field(
        default=0,
        description="Attempts that ended in a pause; they do not count against the retry budget.",
    )
    error: JobError | None
    tracking: TrackingLinks | None = Field(
        default=None,
        description="The job's experiment tracker runs (spec tracking.report_to), once the "
        "trainer started them.",
    )
    priority: int = 0
    queue: QueueInfo | None = Field(
        default=None,
        description="While the job waits (queued, or handed to a SLURM cluster that has not "
        "started it): what it waits for, and while queued its position; null otherwise.",
    )
    evaluation: JobEvaluation | None = Field(
        default=None,
        description="The spec's evaluation as it ran: each model's scores (base, every kept "
        "checkpoint, final), the best checkpoint chosen (then the job's result), or why it "
        "failed (docs/evals.md).",
    )


class UsageDay(Usage):
    date: str = Field(description="UTC day (YYYY-MM-DD) the attempts ended.")
    jobs: int = Field(description="Jobs with an attempt that ended that day.")
    eval_runs: int = Field(default=0, description="Eval runs that ended that day.")
    eval_prompt_tokens: int = Field(default=0, description="Tokens the eval runs' models read.")
    eval_completion_tokens: int = Field(
        default=0, description="Tokens the eval runs' models generated.")
    eval_worker_seconds: float = Field(
        default=0.0, description="Seconds workers held those runs (first claim to end).")


class InferenceUsageDay(BaseModel):
    date: str = Field(description="UTC day (YYYY-MM-DD).")
    model: str = Field(description="The model name as the requests wrote it.")
    requests: int
    prompt_tokens: int
    completion_tokens: int


class UsageReport(BaseModel):
    object: str = "usage"
    start: str = Field(description="First day, inclusive (the `from` parameter).")
    end: str = Field(description="Last day, inclusive (the `to` parameter).")
    price_per_gpu_hour: float | None
    data: list[UsageDay]
    total: Usage
    inference: list[InferenceUsageDay] = Field(
        default_factory=list, description="Inference requests (POST /v1/chat/completions, "
        "/v1/completions) by day and model, as the engine counted their tokens.")


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


class DataEstimate(BaseModel):
    rows: int
    examples: int = Field(description="Training examples kept after tokenization.")
    tokens_per_epoch: int = Field(description="Non-padding tokens of the kept examples.")
    loss_tokens_per_epoch: int = Field(description="Tokens that carry a loss.")
    truncated: int = Field(description="Examples cut at dataset.max_seq_length.")
    dropped: int = Field(description="Examples with no loss token left after truncation.")
    eval_examples: int
    generated_tokens_per_epoch: int | None = Field(
        default=None,
        description="grpo: tokens generated per epoch at most (prompts x num_generations x "
        "max_completion_length), included in tokens_per_epoch.",
    )


class MemoryEstimate(BaseModel):
    total_params: int
    trainable_params: int
    processes: int
    weights_dtype: str
    weights_mb: float = Field(description="Per process, on the accelerator.")
    training_state_mb: float = Field(description="Gradients + optimizer state, per process.")
    activations_mb: float = Field(
        description="Per process: what training holds for backward, the LM head's logits "
        "included (core/model/estimate.py)."
    )
    total_mb: float
    cpu_offloaded_mb: float


class EstimateObject(BaseModel):
    """A dry run (POST /v1/jobs?dry_run=true): the submit's checks passed, nothing recorded."""

    object: str = "estimate"
    spec: dict[str, Any] = Field(description="The spec that would run, every default filled.")
    data: DataEstimate | None = Field(
        description="Exact counts from the data and the model's tokenizer; null when the "
        "tokenizer is not available here (see notes)."
    )
    steps: int | None = Field(description="Optimizer steps in all.")
    epochs: float | None
    trained_tokens: int | None = Field(description="Tokens the run will train, in all.")
    memory: MemoryEstimate | None
    tokens_per_second: float | None = Field(
        description="Median wall-time throughput of succeeded jobs of the same model size on "
        "this fleet; null when there is no history."
    )
    history_jobs: int = Field(description="How many finished jobs that median is from.")
    wall_seconds: float | None = Field(description="trained_tokens / tokens_per_second.")
    gpu_seconds: float | None
    cost: float | None
    currency: str | None
    notes: list[str] = Field(description="What could not be estimated, and why.")
    data_format: dict[str, Any] | None = Field(
        default=None,
        description="What was read from the training data: format (detected when "
        "dataset.format is auto), layout, columns_used, columns_ignored, rows.",
    )
    preview: list[dict[str, Any]] | None = Field(
        default=None,
        description="The first rows as the trainer renders them: per row its tokens "
        "({id, text, loss}), loss_tokens, and kept (false: the row is dropped in training).",
    )


class ModelFile(BaseModel):
    name: str = Field(description="File name inside the model directory.")
    bytes: int = Field(description="Size in bytes.")
    sha256: str = Field(description="Hex SHA-256 of the file, computed as it was published.")
    url: str = Field(description="GET it (HTTP Range supported, to resume a download).")


class ModelFiles(BaseModel):
    """The files of a fully fine-tuned model: together a directory that
    AutoModelFor*.from_pretrained loads (safetensors shards + index, config, generation
    config, tokenizer, README.md model card)."""

    object: str = Field(default="list", description="Always `list`.")
    job_id: str = Field(description="The job that trained the model.")
    checkpoint: int | None = Field(
        default=None, description="The checkpoint's step, or null for the final model.")
    total_bytes: int = Field(description="Sum of the files' sizes.")
    data: list[ModelFile] = Field(description="Every file, in name order.")


class LaunchInfo(BaseModel):
    accelerate_yaml: str
    argv: list[str]
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables the worker added to the launcher's environment (e.g. "
        "ACCELERATE_USE_CPU, OMP_NUM_THREADS): set them too to reproduce the run by hand.",
    )
    sbatch_script: str | None = Field(
        default=None,
        description="SLURM runs: the batch script submitted (argv is then the sbatch command); "
        "srun starts the accelerate launcher once per node.",
    )
    slurm_job_id: str | None = Field(default=None, description="SLURM runs: SLURM's job id.")
    cpus: list[int] | None = Field(
        default=None,
        description="CPU runs pinned to their slot's cores (FTUNE_WORKER_PIN_CPUS): those "
        "cores; run the argv under `taskset -c` with them to reproduce the run by hand.",
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


class WebhookCreate(BaseModel):
    url: str = Field(
        max_length=2048,
        description="https URL the events are POSTed to; it must resolve to a public address "
        "(the operator may allow others).",
    )
    event_types: list[str] | None = Field(
        default=None,
        description="Events to send: job.succeeded, job.failed, job.cancelled, job.running, "
        "job.checkpoint. Default: job.succeeded, job.failed and job.cancelled.",
    )
    description: str = Field(default="", max_length=500)


class WebhookObject(BaseModel):
    id: str
    url: str
    event_types: list[str]
    description: str
    created_at: datetime
    secret: str | None = Field(
        default=None,
        description="The signing secret (`whsec_...`, Standard Webhooks). Shown once, in the "
        "answer to POST /v1/webhooks; verify deliveries with it.",
    )


class WebhookDeleted(BaseModel):
    id: str
    deleted: bool = True


class DeliveryObject(BaseModel):
    id: int
    event_id: str = Field(description="The `webhook-id` header: the same on every retry.")
    event_type: str
    status: str = Field(description="pending, delivered or failed (the retry window ran out)")
    attempts: int
    last_status_code: int | None
    last_error: str | None
    next_attempt_at: datetime | None = Field(description="When a pending delivery is tried.")
    delivered_at: datetime | None
    created_at: datetime


class JobSummary(BaseModel):
    """The job in a webhook event: as it was when the event happened."""

    object: str = Field(description="Always `job`.")
    id: str
    name: str | None
    status: str
    attempt: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: dict[str, int | None] = Field(description="`step` and `total_steps`.")
    adapter_available: bool
    error: JobError | None
    checkpoint: dict[str, Any] | None = Field(
        default=None, description="job.checkpoint only: the checkpoint's `step` and `metrics`."
    )


class WebhookPayload(BaseModel):
    """The body of every delivery, signed as Standard Webhooks does (`webhook-id` is `id`,
    the same on every retry; `webhook-timestamp`; `webhook-signature`)."""

    id: str = Field(description="The event id: de-duplicate on it.")
    type: str
    timestamp: datetime = Field(description="When the event happened.")
    data: JobSummary


class QueueInfo(BaseModel):
    """The one place a job says what it waits for: the scheduler's reason while queued,
    SLURM's (or its unreachable controller's) once a worker handed the job to SLURM."""

    position: int | None = Field(
        description="Queued jobs ahead of this one (priority, then age); null once handed "
        "to SLURM.")
    waiting_for: str = Field(
        description="worker (none registered can run it), gpus, tenant_limit, priority, "
        "dispatch (a worker with room is about to start it), or slurm (a SLURM cluster "
        "holds it back, or its controller does not answer: the message says which)"
    )
    message: str


class WorkerGpu(BaseModel):
    index: int
    name: str
    memory_mb: int
    job_id: str | None = Field(description="The running job holding it, if any.")
    deployment_id: str | None = Field(
        default=None, description="The deployment (engine server) holding it, if any.")


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


class ResumeRequest(BaseModel):
    """Optional body of POST /v1/jobs/{id}/resume: continue on another slice."""

    num_processes: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Processes (GPUs) to continue on; default: as before. The checkpoint's "
        "global batch is kept (the per-device batch and accumulation are adapted), so it "
        "must split over them.",
    )
    strategy: str | None = Field(
        default=None,
        description="distributed.strategy to continue with (e.g. none for one process after "
        "ddp or fsdp); default: as before. DeepSpeed checkpoints continue only under "
        "DeepSpeed on their own process count.",
    )
