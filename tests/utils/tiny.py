"""Tiny offline models and datasets for tests (the same builders `ftune demo` uses)."""

from cli.demo_assets import *
from cli.demo_assets import (  # noqa: F401
    build_causal_lm,
    build_seq2seq_lm,
    build_seq_cls,
    build_tokenizer,
    chat_rows,
    classification_rows,
    kto_rows,
    preference_rows,
    prompt_completion_rows,
    sentences,
    seq2seq_rows,
    text_rows,
    tiny_llama_config,
    write_jsonl,
)


def reinforcement_rows(n: int, seed: int = 3, **fields: object) -> list[dict]:
    """OpenAI's reinforcement layout: a user prompt and the fields graders read
    ({{item.animal}} is "dog" unless ``fields`` say otherwise)."""
    return [{"messages": [{"role": "user", "content": s}], "animal": "dog", **fields}
            for s in sentences(n, seed)]


def openai_dpo_rows(n: int, seed: int = 6) -> list[dict]:
    """preference_rows in OpenAI's DPO layout (input.messages, preferred_output,
    non_preferred_output)."""
    return [{"input": {"messages": [{"role": "user", "content": r["prompt"]}]},
             "preferred_output": [{"role": "assistant", "content": r["chosen"]}],
             "non_preferred_output": [{"role": "assistant", "content": r["rejected"]}]}
            for r in preference_rows(n, seed)]
