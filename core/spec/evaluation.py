"""The job spec's ``evaluation`` section (evaluation inside fine-tuning, issue 33): evals of
the tenant's, each with the data it runs on; which models are scored (the base model, every
kept checkpoint, the final model); and the one criterion whose best checkpoint may become
the job's result. The data a run reads (its source, its messages, its sampling parameters)
are OpenAI's Evals API shapes, defined here since the spec is the lowest layer; the Evals
API (core/evals/spec.py) uses the same classes. What relates the section to the tenant's
evals and files is checked at submit (core/evals/training.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CONTENT_ROWS = 10_000
MAX_EVALS = 8
Stage = Literal["base", "checkpoints", "final"]
STAGES: tuple[Stage, ...] = ("base", "checkpoints", "final")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentRow(_Strict):
    item: dict[str, Any] = Field(description="The item: an object the eval's item_schema "
                                 "accepts.")
    sample: dict[str, Any] | None = Field(
        default=None, description="A given answer ({output_text}); a jsonl run grades it, a "
        "completions run ignores it.")


class FileContentSource(_Strict):
    type: Literal["file_content"] = Field(description="The rows are in the request.")
    content: list[ContentRow] = Field(min_length=1, max_length=MAX_CONTENT_ROWS,
                                      description="The rows, {item, sample?} each.")


class FileIdSource(_Strict):
    type: Literal["file_id"] = Field(description="The rows are an uploaded file's.")
    id: str = Field(min_length=1, max_length=64, description="A file uploaded with purpose evals.")


Source = Annotated[FileContentSource | FileIdSource, Field(discriminator="type")]


class TemplateMessage(_Strict):
    role: Literal["user", "assistant", "system", "developer"] = Field(
        description="The message's role.")
    content: str = Field(max_length=100_000, description="Text with {{item.field}} tags.")
    type: Literal["message"] | None = Field(default=None, description="OpenAI's optional tag.")


class TemplateInput(_Strict):
    type: Literal["template"] = Field(description="Messages rendered from each item.")
    template: list[TemplateMessage] = Field(min_length=1, max_length=64,
                                            description="The messages, in order.")


class ItemReferenceInput(_Strict):
    type: Literal["item_reference"] = Field(description="Messages held by each item.")
    item_reference: str = Field(
        pattern=r"^item(\.[A-Za-z_][A-Za-z0-9_]*)+$",
        description="item.<field>: the field holds the chat messages to send.",
    )


InputMessages = Annotated[TemplateInput | ItemReferenceInput, Field(discriminator="type")]


class CompletionsSamplingParams(_Strict):
    temperature: float | None = Field(default=None, ge=0, le=2,
                                      description="Sampling temperature (default 1).")
    top_p: float | None = Field(default=None, gt=0, le=1,
                                description="Nucleus sampling mass (default 1).")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=32_768, description="Longest answer in tokens (default 256).")
    seed: int | None = Field(default=None, description="The engine's sampling seed.")
    # OpenAI's fields that have no meaning for the models served here: refused unless unset.
    reasoning_effort: str | None = Field(default=None, description="Refused: no reasoning "
                                         "models are served here.")
    response_format: dict[str, Any] | None = Field(default=None, description="Refused.")
    tools: list[dict[str, Any]] | None = Field(default=None, description="Refused.")


class EvalOnTraining(_Strict):
    eval_id: str = Field(max_length=64, description="An eval of yours (POST /v1/evals).")
    input_messages: InputMessages = Field(
        description="The messages sent for each item (a template over {{item.*}}, or an "
        "item_reference), as in a completions run.")
    sampling_params: CompletionsSamplingParams | None = Field(
        default=None, description="As in a completions run (temperature 0 compares models "
        "without sampling noise).")
    source: Source = Field(description="The items: file_content rows, or a file_id uploaded "
                           "with purpose evals.")


class SelectBest(_Strict):
    eval_id: str = Field(max_length=64, description="One of evaluation.evals.")
    criterion: str = Field(description="A testing criterion of that eval, by name.")
    by: Literal["pass_rate", "mean_score"] = Field(
        default="pass_rate", description="Which of the criterion's figures ranks checkpoints.")


class EvaluationSpec(_Strict):
    evals: list[EvalOnTraining] = Field(
        min_length=1, max_length=MAX_EVALS, description="The evals that score each model, "
        "each with its items and messages.")
    on: list[Stage] = Field(
        default_factory=lambda: list(STAGES), min_length=1,
        description="Which models are scored: base (the base model, a catalog model), "
        "checkpoints (every kept checkpoint, ft:...:ckpt-step-N), final (the job's model).")
    select_best: SelectBest | None = Field(
        default=None, description="Make the best checkpoint by this criterion the job's result "
        "(fine_tuned_model names it; an event says why). The highest figure wins; of equals, "
        "the fewest steps. Needs checkpoints in on.")
