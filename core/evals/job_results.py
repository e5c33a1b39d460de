"""What a job's evaluation found (``jobs.evaluation``, the job object's ``evaluation``):
each model's scores and the best checkpoint chosen. Written by core/evals/job_evaluation.py
and read by the API with the same classes; pydantic only, so the API's schemas import it
without the executor."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from core.db.models import Job, JobStatus
from core.infra.errors import ErrorCode
from core.spec.evaluation import Stage


class CriterionScore(BaseModel):
    pass_rate: float | None  # passed / graded (errored items left out); None: none graded
    mean_score: float | None


class ModelScore(BaseModel):
    stage: Stage
    step: int | None  # a checkpoint's; None for the base and the final model
    model: str
    eval_id: str
    run_id: str
    status: str  # the run's: completed | failed | canceled
    error: str | None = None
    result_counts: dict[str, int]
    criteria: dict[str, CriterionScore]


class Best(BaseModel):
    model: str
    step: int | None
    eval_id: str
    criterion: str
    by: Literal["pass_rate", "mean_score"]
    score: float
    reason: str


class JobEvaluation(BaseModel):
    """``jobs.evaluation``, written and read by this class (the job object shows it)."""

    status: Literal["running", "completed", "failed", "canceled"]
    scores: list[ModelScore] = []
    best: Best | None = None
    error: str | None = None


def artifact_kept(job: Job) -> bool:
    """The job's final artifact is its to download: it succeeded, or it failed only in its
    evaluation (the artifact was verified before the evaluation began)."""
    return job.adapter_path is not None and (job.status == JobStatus.succeeded or (
        job.status == JobStatus.failed and job.error_code == ErrorCode.evaluation_failed))


def result_model(job_model: str, evaluation: JobEvaluation | None) -> str:
    """The job's result by name: its best checkpoint's when select_best chose one."""
    return evaluation.best.model if evaluation and evaluation.best else job_model
