"""spec.dataset: where the training data is, its format, and its column names."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.spec.base import _Strict

DataFormat = Literal[
    "text", "prompt_completion", "chat", "seq2seq", "classification", "preference", "kto"
]
Objective = Literal["sft", "dpo", "orpo", "kto", "grpo"]

# Which data formats each task can learn from.
FORMATS_BY_TASK: dict[str, tuple[str, ...]] = {
    "causal_lm": ("text", "prompt_completion", "chat", "preference", "kto"),
    "seq2seq_lm": ("seq2seq", "prompt_completion"),
    "seq_cls": ("classification",),
}


class DatasetSpec(_Strict):
    file_id: str | None = Field(
        default=None,
        description="An uploaded file (POST /v1/files): JSONL, a JSON array of objects, either "
        "gzip-compressed (.jsonl.gz, .json.gz), CSV or Parquet.",
    )
    path: str | None = Field(
        default=None,
        description="Under an allowed data root: a file (as for file_id), a directory of such "
        "files, or a directory written by datasets' save_to_disk (one split).",
    )
    eval_file_id: str | None = Field(default=None, description="Uploaded file for evaluation.")
    eval_path: str | None = Field(
        default=None, description="Evaluation data under a data root (as for path)."
    )
    eval_split: float = Field(
        default=0.0, ge=0.0, lt=0.5, description="Fraction of training rows held out for eval."
    )
    format: DataFormat = Field(
        default="text",
        description="text: one field of raw text; prompt_completion: loss on completion only; "
        "chat: list of {role, content} rendered with the tokenizer's chat template (the "
        "model's tokenizer must have one); seq2seq: "
        "input/target; classification: text/label; preference (training.objective dpo or "
        "orpo): prompt/chosen/rejected, each plain text, or the prompt a list of {role, "
        "content} messages and chosen/rejected the assistant reply (text or messages), "
        "rendered with the chat template; kto (training.objective kto): unpaired "
        "prompt/completion/label, label true for a desirable completion, false for an "
        "undesirable one.",
    )
    text_field: str = Field(
        default="text",
        min_length=1,
        max_length=128,
        description="text and classification: the column holding the text.",
    )
    prompt_field: str = Field(
        default="prompt",
        min_length=1,
        max_length=128,
        description="prompt_completion, preference and kto: the column holding the prompt.",
    )
    completion_field: str = Field(
        default="completion",
        min_length=1,
        max_length=128,
        description="prompt_completion: the completion the loss is computed on; kto: the "
        "completion that label_field judges.",
    )
    messages_field: str = Field(
        default="messages",
        min_length=1,
        max_length=128,
        description="chat: the column holding the list of {role, content} messages.",
    )
    input_field: str = Field(
        default="input",
        min_length=1,
        max_length=128,
        description="seq2seq: the column holding the source text (the encoder's input).",
    )
    target_field: str = Field(
        default="target",
        min_length=1,
        max_length=128,
        description="seq2seq: the column holding the text the decoder learns to produce.",
    )
    label_field: str = Field(
        default="label",
        min_length=1,
        max_length=128,
        description="classification: the class name or id; kto: true (desirable) or false.",
    )
    chosen_field: str = Field(
        default="chosen",
        min_length=1,
        max_length=128,
        description="preference: the preferred answer to the prompt.",
    )
    rejected_field: str = Field(
        default="rejected",
        min_length=1,
        max_length=128,
        description="preference: the dispreferred answer to the same prompt.",
    )
    max_seq_length: int = Field(
        default=1024, ge=8, le=131_072, description="Tokens per example; longer are truncated."
    )
    packing: bool = Field(
        default=False,
        description="causal_lm: pack several examples per row (attention stays per example).",
    )

    def required_fields(self) -> list[tuple[str, str]]:
        """(spec param, column name) pairs the data must have for this format."""
        by_format: dict[str, list[str]] = {
            "text": ["text_field"],
            "prompt_completion": ["prompt_field", "completion_field"],
            "chat": ["messages_field"],
            "seq2seq": ["input_field", "target_field"],
            "classification": ["text_field", "label_field"],
            "preference": ["prompt_field", "chosen_field", "rejected_field"],
            "kto": ["prompt_field", "completion_field", "label_field"],
        }
        return [(f"dataset.{name}", getattr(self, name)) for name in by_format[self.format]]
