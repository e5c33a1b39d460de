"""spec.dataset: where the training data is, its format, and its column names."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from core.spec.base import _Strict
from core.spec.chat_templates import template_problem

DataFormat = Literal[
    "auto",
    "text",
    "prompt_completion",
    "chat",
    "alpaca",
    "sharegpt",
    "seq2seq",
    "classification",
    "preference",
    "kto",
]

# Which data formats each task can learn from.
FORMATS_BY_TASK: dict[str, tuple[str, ...]] = {
    "causal_lm": ("text", "prompt_completion", "chat", "alpaca", "sharegpt", "preference", "kto"),
    "seq2seq_lm": ("seq2seq", "prompt_completion"),
    "seq_cls": ("classification",),
}


class ShareGptTags(_Strict):
    """LLaMA-Factory's dataset_info.json ``tags``: the keys and role values of ShareGPT turns."""

    role_tag: str = Field(default="from", min_length=1, max_length=64,
                          description="The key holding a turn's role.")
    content_tag: str = Field(default="value", min_length=1, max_length=64,
                             description="The key holding a turn's text.")
    user_tag: str = Field(default="human", min_length=1, max_length=64,
                          description="The role value of the user's turns.")
    assistant_tag: str = Field(default="gpt", min_length=1, max_length=64,
                               description="The role value of the model's turns (learned).")
    observation_tag: str = Field(default="observation", min_length=1, max_length=64,
                                 description="The role value of a tool's answer.")
    function_tag: str = Field(default="function_call", min_length=1, max_length=64,
                              description="The role value of the model's tool call (JSON).")
    system_tag: str = Field(default="system", min_length=1, max_length=64,
                            description="The role value of a first system turn.")


# The roles a dataset.columns mapping may name (core/data/formats: each layout's roles).
COLUMN_ROLES = (
    "prompt", "query", "response", "system", "history", "messages", "tools", "functions",
    "chosen", "rejected", "kto_tag", "completion", "text", "label", "input", "target",
)


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
        default="auto",
        description="auto (the default): detected from the rows' columns among the formats "
        "the task and objective train on; the dry run, the job object and the started event "
        "say what was detected and which columns were used and ignored. text: one field of "
        "raw text; prompt_completion: loss on completion only; chat: OpenAI chat lines "
        "(messages of {role, content}, per-message weight 0/1, tools/functions, tool_calls, "
        "name, text content parts) rendered with the chat template; alpaca: instruction + "
        "input -> output (optional system, history); sharegpt: conversations of {from, "
        "value} (human, gpt, system, function_call, observation) and tools; seq2seq: "
        "input/target; classification: text/label; preference (training.objective dpo or "
        "orpo): TRL's prompt/chosen/rejected (text or messages, or chosen/rejected alone "
        "with an implicit prompt), OpenAI's DPO rows (input.messages, preferred_output, "
        "non_preferred_output) or LLaMA-Factory's ShareGPT pairs; kto (training.objective "
        "kto): prompt/completion/label or messages + label (the last assistant message is "
        "the completion), label true for a desirable completion.",
    )
    columns: dict[str, Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        default=None,
        description="Which column plays which role, for files that name them otherwise "
        "(LLaMA-Factory's dataset_info.json `columns`): prompt, query, response, system, "
        "history, messages, tools, functions, chosen, rejected, kto_tag, completion, text, "
        "label, input, target. E.g. alpaca with {\"prompt\": \"question\", \"response\": "
        "\"answer\"}.",
    )
    tags: ShareGptTags | None = Field(
        default=None, description="sharegpt: the role and content keys of each turn, and the "
        "role values (LLaMA-Factory's dataset_info.json `tags`)."
    )
    chat_template: str | None = Field(
        default=None,
        max_length=65_536,
        description="Override the tokenizer's chat template: a named one (chatml) or a "
        "Jinja template string; checked at submit by rendering a conversation.",
    )
    skip_rows_without_loss: bool = Field(
        default=False,
        description="Rows whose rendering leaves no token to learn (the template drops the "
        "assistant text) are refused at submit, naming them; true skips and counts them.",
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

    @field_validator("chat_template")
    @classmethod
    def _usable_template(cls, v: str | None) -> str | None:
        if v is not None and (problem := template_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @field_validator("columns")
    @classmethod
    def _known_roles(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        import difflib

        for role in v or {}:
            if role not in COLUMN_ROLES:
                close = difflib.get_close_matches(role, COLUMN_ROLES, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"unknown role {role!r}{hint}; roles: {', '.join(COLUMN_ROLES)}"
                )
        return v
