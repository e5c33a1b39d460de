"""The Evals API's request shapes (OpenAI's names): an eval's data source config and testing
criteria, and a run's data source. Field checks live on the models; what relates them (a
template naming a field the item schema lacks, rows against the schema) is in
core/evals/checks.py.

Testing criteria are ftune's graders (core/graders/): string_check, text_similarity, python,
score_model, multi (an extension: OpenAI's evals take no multi), plus label_model; the
scoring ones carry ``pass_threshold``. Importable without torch."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from core.graders.label import LabelModelGrader
from core.spec.evaluation import (  # the run sources: shared with the job spec's evaluation
    MAX_CONTENT_ROWS,
    CompletionsSamplingParams,
    ContentRow,
    FileContentSource,
    FileIdSource,
    InputMessages,
    ItemReferenceInput,
    Source,
    TemplateInput,
    TemplateMessage,
)
from core.spec.graders import (
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)

MAX_CRITERIA = 16
MAX_SCHEMA_BYTES = 64 * 1024
# A scoring criterion without pass_threshold passes at this score (OpenAI leaves it unsaid).
DEFAULT_PASS_THRESHOLD = 0.5

Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16, description="Up to 16 keys (64 characters) with text values (512)."),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


PassThreshold = Annotated[float, Field(
    ge=0, le=1, description="The score at or above which an item passes this criterion.")]


class TextSimilarityCriterion(TextSimilarityGrader):
    pass_threshold: PassThreshold


class PythonCriterion(PythonGrader):
    pass_threshold: PassThreshold | None = None


class ScoreModelCriterion(ScoreModelGrader):
    pass_threshold: PassThreshold | None = None


class MultiCriterion(MultiGrader):
    pass_threshold: PassThreshold | None = None


CRITERION_TYPES = ("string_check", "text_similarity", "python", "score_model", "multi",
                   "label_model")


def _criterion_type(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if isinstance(t, str) else None


Criterion = Annotated[
    Annotated[StringCheckGrader, Tag("string_check")]
    | Annotated[TextSimilarityCriterion, Tag("text_similarity")]
    | Annotated[PythonCriterion, Tag("python")]
    | Annotated[ScoreModelCriterion, Tag("score_model")]
    | Annotated[MultiCriterion, Tag("multi")]
    | Annotated[LabelModelGrader, Tag("label_model")],
    Discriminator(
        _criterion_type,
        custom_error_type="invalid_grader_type",
        custom_error_message=f"type must be one of {', '.join(CRITERION_TYPES)}",
    ),
]


def pass_threshold(c: Criterion) -> float:
    """The score an item needs to pass ``c`` (string_check and label_model score 0 or 1)."""
    if isinstance(c, (StringCheckGrader, LabelModelGrader)):
        return 1.0
    given = getattr(c, "pass_threshold", None)
    return DEFAULT_PASS_THRESHOLD if given is None else float(given)


class CustomDataSourceConfig(_Strict):
    type: Literal["custom"] = Field(description="Always custom (logs and stored completions "
                                    "are OpenAI's stores, which ftune does not have).")
    item_schema: dict[str, Any] = Field(description="JSON Schema of each item (an object).")
    include_sample_schema: bool = Field(
        default=False, description="Runs generate (or carry) a sample: graders may read "
        "{{sample.output_text}}.")


class EvalCreate(_Strict):
    name: str | None = Field(default=None, max_length=256)
    metadata: Metadata | None = None
    data_source_config: CustomDataSourceConfig
    testing_criteria: list[Criterion] = Field(min_length=1, max_length=MAX_CRITERIA)


class EvalUpdate(_Strict):
    name: str | None = Field(default=None, max_length=256)
    metadata: Metadata | None = None


# --------------------------------------------------------------------------- run sources


class CompletionsDataSource(_Strict):
    type: Literal["completions"]
    model: str = Field(min_length=1, max_length=256, description="A catalog model, an ft: "
                       "name or a checkpoint's ft: name (…:ckpt-step-N).")
    input_messages: InputMessages
    sampling_params: CompletionsSamplingParams | None = None
    source: Source


class JsonlDataSource(_Strict):
    type: Literal["jsonl"]
    source: Source


DataSource = Annotated[CompletionsDataSource | JsonlDataSource, Field(discriminator="type")]


class RunCreate(_Strict):
    name: str | None = Field(default=None, max_length=256)
    metadata: Metadata | None = None
    data_source: DataSource


# The run sources, defined with the job spec's evaluation section, are this module's too.
__all__ = ["MAX_CONTENT_ROWS", "CompletionsSamplingParams", "ContentRow", "FileContentSource",
           "FileIdSource", "InputMessages", "ItemReferenceInput", "Source", "TemplateInput",
           "TemplateMessage"]
