"""OpenAI's objects and request bodies, field for field as openai-python 3.51 types them
(types/fine_tuning/, types/file_object.py, types/model.py). Each response object has its
exact literal ``object``; fields of ours come after OpenAI's, under names OpenAI does not
use."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

Auto = Literal["auto"]
T = TypeVar("T")
OpenAIStatus = Literal["validating_files", "queued", "running", "succeeded", "failed",
                       "cancelled", "pausing", "paused"]


class _Request(BaseModel):
    # OpenAI answers an unknown argument with a 400 naming it; so do we.
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- requests


class HyperparametersIn(_Request):
    batch_size: Auto | int | None = Field(default=None)
    learning_rate_multiplier: Auto | float | None = Field(default=None)
    n_epochs: Auto | int | None = Field(default=None)

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v: Auto | int | None) -> Auto | int | None:
        if isinstance(v, int) and not 1 <= v <= 256:
            raise ValueError("must be 'auto' or an integer from 1 to 256")
        return v

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, v: Auto | int | None) -> Auto | int | None:
        if isinstance(v, int) and not 1 <= v <= 50:
            raise ValueError("must be 'auto' or an integer from 1 to 50")
        return v

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _multiplier(cls, v: Auto | float | None) -> Auto | float | None:
        if isinstance(v, float | int) and not 0 < v <= 10:
            raise ValueError("must be 'auto' or a number above 0 and at most 10")
        return v


class DpoHyperparametersIn(HyperparametersIn):
    beta: Auto | float | None = Field(default=None)

    @field_validator("beta")
    @classmethod
    def _beta(cls, v: Auto | float | None) -> Auto | float | None:
        if isinstance(v, float | int) and not 0 < v <= 2:
            raise ValueError("must be 'auto' or a number above 0 and at most 2")
        return v


class ReinforcementHyperparametersIn(HyperparametersIn):
    """Mapped onto training.grpo by api/openai/reinforcement.py (openai_reinforcement_fields)."""

    compute_multiplier: Auto | float | None = Field(default=None)
    eval_interval: Auto | int | None = Field(default=None)
    eval_samples: Auto | int | None = Field(default=None)
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = Field(
        default=None, description="Refused unless unset or default (no meaning here).")

    @field_validator("compute_multiplier")
    @classmethod
    def _compute(cls, v: Auto | float | None) -> Auto | float | None:
        # 8 x multiplier answers per prompt: from 2 to 256.
        if isinstance(v, float | int) and not 0.25 <= v <= 32:
            raise ValueError("must be 'auto' or a number from 0.25 to 32")
        return v

    @field_validator("eval_interval", "eval_samples")
    @classmethod
    def _positive(cls, v: Auto | int | None) -> Auto | int | None:
        if isinstance(v, int) and not 1 <= v <= 100_000:
            raise ValueError("must be 'auto' or an integer from 1 to 100000")
        return v


class ReinforcementIn(_Request):
    # Parsed by api/services/graders.py (checked_grader), whose problems name the field.
    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparametersIn | None = None


class SupervisedIn(_Request):
    hyperparameters: HyperparametersIn | None = None


class DpoIn(_Request):
    hyperparameters: DpoHyperparametersIn | None = None


class MethodIn(_Request):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedIn | None = None
    dpo: DpoIn | None = None
    reinforcement: ReinforcementIn | None = None


class WandbIn(_Request):
    project: str = Field(min_length=1, max_length=128)
    entity: str | None = Field(default=None, max_length=128)
    name: str | None = Field(default=None, max_length=128)
    tags: list[str] | None = Field(default=None, max_length=20)


class IntegrationIn(_Request):
    type: Literal["wandb"]
    wandb: WandbIn


class JobCreate(_Request):
    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(default=None, max_length=64)
    hyperparameters: HyperparametersIn | None = Field(
        default=None, description="Deprecated by OpenAI in favour of method; read for the "
        "supervised method.")
    method: MethodIn | None = None
    suffix: str | None = Field(default=None, min_length=1, max_length=64)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    integrations: list[IntegrationIn] | None = Field(default=None, max_length=5)
    evaluation: dict[str, Any] | None = Field(
        default=None, description="ftune's extension (the SDK's extra_body): the job spec's "
        "evaluation section, checked as a JobSpec's (docs/evals.md).")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():
            if not 1 <= len(key) <= 64:
                raise ValueError(f"key {key[:70]!r}: keys are 1 to 64 characters")
            if len(value) > 512:
                raise ValueError(f"value of {key!r}: values are at most 512 characters")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v is not None and not v.isprintable():
            raise ValueError("must be printable characters")
        return v


# --------------------------------------------------------------------------- responses


class JobErrorOut(BaseModel):
    code: str
    message: str
    param: str | None = None


class HyperparametersOut(BaseModel):
    batch_size: int | None = None
    learning_rate_multiplier: float | None = None
    n_epochs: int | None = None


class DpoHyperparametersOut(HyperparametersOut):
    beta: float | None = None


class SupervisedOut(BaseModel):
    hyperparameters: HyperparametersOut


class DpoOut(BaseModel):
    hyperparameters: DpoHyperparametersOut


class ReinforcementHyperparametersOut(HyperparametersOut):
    compute_multiplier: float | None = None
    eval_interval: int | None = None
    eval_samples: int | None = None
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = None


class ReinforcementOut(BaseModel):
    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparametersOut


class MethodOut(BaseModel):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedOut | None = None
    dpo: DpoOut | None = None
    reinforcement: ReinforcementOut | None = None


class WandbOut(BaseModel):
    project: str
    entity: str | None = None
    name: str | None = None
    tags: list[str] | None = None


class IntegrationOut(BaseModel):
    type: Literal["wandb"] = "wandb"
    wandb: WandbOut


class Placement(BaseModel):
    """Where ftune decided the job runs (OpenAI users do not choose sharding)."""

    strategy: str
    num_processes: int
    reason: str


class FineTuningJob(BaseModel):
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    id: str
    created_at: int
    error: JobErrorOut | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: HyperparametersOut
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: OpenAIStatus
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[IntegrationOut] | None = None
    metadata: dict[str, str] | None = None
    method: MethodOut | None = None
    suffix: str | None = Field(default=None, description="ftune: the suffix as given.")
    ftune_status: str = Field(description="ftune: the job's own status (e.g. cancelling).")
    placement: Placement | None = Field(
        default=None, description="ftune: the strategy and process count it was given.")
    ftune_notes: list[str] | None = Field(
        default=None, description="ftune: values of the request not run as asked, and why.")


class JobEvent(BaseModel):
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    id: str
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class JobCheckpoint(BaseModel):
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class ListOf(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False


class ModelOut(BaseModel):
    object: Literal["model"] = "model"
    id: str
    created: int
    owned_by: str
    ftune_location: str | None = Field(default=None, description="ftune: catalog models' "
                                       "path or hub id.")
    ftune_job_id: str | None = Field(default=None, description="ftune: a fine-tuned model's job.")


class WebhookEventData(BaseModel):
    id: str = Field(description="The fine-tuning job's id.")


class WebhookEvent(BaseModel):
    """The body of a fine_tuning.job.* delivery, as OpenAI sends it (signed the same way:
    ``client.webhooks.unwrap(body, headers, secret=...)`` verifies and parses it)."""

    id: str = Field(description="The event id (also `webhook-id`): de-duplicate on it.")
    object: Literal["event"] = "event"
    created_at: int
    type: Literal["fine_tuning.job.succeeded", "fine_tuning.job.failed",
                  "fine_tuning.job.cancelled"]
    data: WebhookEventData
