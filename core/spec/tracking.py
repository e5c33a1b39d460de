"""spec.tracking: which experiment trackers log the job."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from core.spec.base import _Strict

Tracker = Literal["tensorboard", "mlflow", "wandb"]
_TAG = Annotated[str, Field(min_length=1, max_length=250)]


class TrackingSpec(_Strict):
    """Experiment tracking: which trackers log this job. Where they write is the operator's
    choice (server settings), not the spec's."""

    report_to: list[Tracker] = Field(
        default_factory=list,
        max_length=3,
        description="Trackers that log params (the spec as it ran), metric curves and the "
        "final adapter: tensorboard (event files in the job directory, GET "
        "/v1/jobs/{id}/tensorboard), mlflow (the operator's tracking server), wandb (the "
        "operator's W&B project; offline runs are kept in the job directory). Each must be "
        "enabled on the server. The job object's tracking field links the runs.",
    )
    run_name: str | None = Field(
        default=None, max_length=200, description="Run name in MLflow / W&B; default: the job id."
    )
    tags: dict[_TAG, Annotated[str, Field(max_length=5000)]] = Field(
        default_factory=dict,
        max_length=50,
        description="Tags on the MLflow run; on the W&B run as key=value labels (cut to 64 "
        "characters) and in its config. ftune adds ftune.job_id and ftune.tenant_id.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        max_length=1000,
        description="An MLflow tracking URI the server allows (its "
        "mlflow_allowed_tracking_uris); default: the server's.",
    )

    @field_validator("run_name")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and any(ord(c) < 32 for c in v):
            raise ValueError("must not contain control characters")
        return v
