"""The whole job spec: its sections, the resources and the queue priority."""

from __future__ import annotations

from pydantic import Field, field_validator

from core.spec.base import _Strict
from core.spec.data import DatasetSpec
from core.spec.distributed import DistributedSpec
from core.spec.evaluation import EvaluationSpec
from core.spec.model import ModelSpec
from core.spec.peft import LoraSpec, PeftSpec
from core.spec.tracking import TrackingSpec
from core.spec.training import TrainingSpec


class ResourcesSpec(_Strict):
    timeout_seconds: int | None = Field(
        default=None, ge=1, le=30 * 24 * 3600, description="Wall-clock limit; then failed."
    )


class JobSpec(_Strict):
    name: str | None = Field(default=None, max_length=200, description="Optional label.")
    model: ModelSpec = Field(description="The base model to adapt, and how it is loaded.")
    dataset: DatasetSpec = Field(
        description="The training (and evaluation) data, its format and its columns."
    )
    peft: PeftSpec = Field(
        default_factory=LoraSpec,
        description="The adapter method and its options (or method full: every weight "
        "trains, no adapter); default: LoRA."
    )
    training: TrainingSpec = Field(
        default_factory=TrainingSpec,
        description="The objective and the Trainer's hyper-parameters.",
    )
    distributed: DistributedSpec = Field(
        default_factory=DistributedSpec,
        description="How many processes on how many machines, and how they share the model.",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Limits on the run."
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Experiment trackers that log the run."
    )
    evaluation: EvaluationSpec | None = Field(
        default=None,
        description="Evals run on the base model, every kept checkpoint and the final model "
        "after training, before the job is final; the best checkpoint by one criterion may "
        "become the result (docs/evals.md).",
    )
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="Queue priority: higher runs first, first come first served within a "
        "priority. Each tenant may use up to its bound (FTUNE_MAX_PRIORITY, or its entry in "
        "FTUNE_TENANT_LIMITS); more is a 422.",
    )

    @field_validator("name")
    @classmethod
    def _no_control_chars(cls, v: str | None) -> str | None:
        if v is not None and any(ord(c) < 32 for c in v):
            raise ValueError("must not contain control characters")
        return v
