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
