"""OpenAI's eval objects as the API answers them (openai-python types/evals/: exact
``object`` strings, unix-second timestamps); what ftune adds is said per field."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")


class EvalList(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class CustomConfigOut(BaseModel):
    type: Literal["custom"] = "custom"
    schema_: dict[str, Any] = Field(alias="schema", serialization_alias="schema",
                                    description="{item, sample?}: what templates may reference.")


class EvalOut(BaseModel):
    object: Literal["eval"] = "eval"
    id: str
    name: str
    created_at: int
    metadata: dict[str, str] | None = None
    data_source_config: CustomConfigOut
    testing_criteria: list[dict[str, Any]]


class EvalDeleted(BaseModel):
    object: Literal["eval.deleted"] = "eval.deleted"
    deleted: bool = True
    eval_id: str


class ApiError(BaseModel):
    code: str = Field(description="Empty when there is no error (OpenAI's type has no null).")
    message: str


class ResultCounts(BaseModel):
    total: int
    passed: int
    failed: int
    errored: int


class CriterionResult(BaseModel):
    testing_criteria: str
    passed: int
    failed: int
    errored: int = Field(default=0, description="ftune: items the criterion errored on.")


class ModelUsage(BaseModel):
    model_name: str
    invocation_count: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int


class RunOut(BaseModel):
    object: Literal["eval.run"] = "eval.run"
    id: str
    eval_id: str
    name: str
    model: str = Field(description="The completions source's model; empty for jsonl runs.")
    status: str = Field(description="queued, in_progress, canceling, completed, failed, "
                        "canceled.")
    created_at: int
    data_source: dict[str, Any]
    error: ApiError
    metadata: dict[str, str] | None = None
    result_counts: ResultCounts
    per_testing_criteria_results: list[CriterionResult]
    per_model_usage: list[ModelUsage]
    report_url: str = Field(description="The run in ftune's dashboard.")
    started_at: int | None = Field(default=None, description="ftune: unix seconds.")
    finished_at: int | None = Field(default=None, description="ftune: unix seconds.")
    attempt: int = Field(default=0, description="ftune: workers that took the run (a "
                         "resumed run has more than one).")


class RunDeleted(BaseModel):
    object: Literal["eval.run.deleted"] = "eval.run.deleted"
    deleted: bool = True
    run_id: str


class OutputItemOut(BaseModel):
    object: Literal["eval.run.output_item"] = "eval.run.output_item"
    id: str
    eval_id: str
    run_id: str
    created_at: int
    datasource_item_id: int
    datasource_item: dict[str, Any]
    status: str = Field(description="pass, fail, or error (a criterion errored on the item, "
                        "or its answer could not be generated; the reason is on it).")
    results: list[dict[str, Any]]
    sample: dict[str, Any]


class CriterionComparison(BaseModel):
    testing_criteria: str
    items: int = Field(description="Items both runs graded without error on this criterion.")
    base_pass_rate: float
    candidate_pass_rate: float
    pass_rate_difference: float = Field(description="candidate - base.")
    pass_rate_interval: list[float] = Field(description="Paired bootstrap 95% interval.")
    base_mean_score: float
    candidate_mean_score: float
    mean_score_difference: float
    mean_score_interval: list[float]


class FlippedItem(BaseModel):
    datasource_item_id: int
    testing_criteria: str
    direction: Literal["gained", "lost"] = Field(description="gained: fails in base, passes "
                                                  "in candidate; lost: the reverse.")
    item: dict[str, Any]
    base_answer: str | None
    candidate_answer: str | None


class RunComparison(BaseModel):
    object: Literal["eval.run.comparison"] = "eval.run.comparison"
    eval_id: str
    base_run_id: str
    candidate_run_id: str
    seed: int
    resamples: int
    criteria: list[CriterionComparison]
    flipped: list[FlippedItem]
