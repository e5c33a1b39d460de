"""The training data as the trainer will see it, counted before a GPU is asked for: examples,
tokens and loss tokens tokenized by the trainer's own code (core/data/datasets.py) with the
model's tokenizer, the optimizer steps they make, and the first rows as rendered."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.spec import JobSpec


@dataclass
class TokenCount:
    """The training data as the trainer will see it: tokenized by the trainer's own code
    (core/data/datasets.py) with the model's tokenizer, so the counts are the run's, not a guess."""

    rows: int
    examples: int
    batch_rows: int  # rows the dataloader batches: examples, or packed rows with packing
    tokens: int  # per epoch, no padding
    loss_tokens: int  # per epoch
    truncated: int
    dropped: int
    eval_examples: int
    # grpo: tokens the policy generates per epoch at most (answers x max_completion_length).
    generated_tokens: int = 0


def count_tokens(
    spec: JobSpec,
    model_path: str,
    train_path: Any,
    eval_path: Any | None,
    max_decompressed_bytes: int | None = None,
) -> TokenCount:
    """Raises OSError/ValueError (and the trainer's classified errors) when the tokenizer
    or the data cannot be read."""
    from core.data.datasets import build_datasets
    from core.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec, model_path)
    if spec.training.objective == "grpo":
        return _count_grpo(spec, tokenizer, train_path, eval_path, max_decompressed_bytes)
    data = build_datasets(spec, train_path, eval_path, tokenizer, max_decompressed_bytes)
    st = data.train.stats
    return TokenCount(
        rows=st.rows,
        examples=st.examples if st.examples else len(data.train),
        batch_rows=len(data.train),
        tokens=st.tokens,
        loss_tokens=st.loss_tokens,
        truncated=st.truncated,
        dropped=st.dropped,
        eval_examples=len(data.eval) if data.eval is not None else 0,
    )


def preview(
    spec: JobSpec,
    model_path: str,
    train_path: Any,
    resolution: Any,
    n: int,
    max_decompressed_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """The first ``n`` training rows as the trainer renders them (core.data.preview)."""
    from core.data.preview import preview as render_preview
    from core.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec, model_path)
    return render_preview(spec, tokenizer, train_path, resolution, n, max_decompressed_bytes)


def _count_grpo(
    spec: JobSpec, tokenizer: Any, train_path: Any, eval_path: Any | None,
    max_decompressed_bytes: int | None,
) -> TokenCount:
    """GRPO's data: prompts rendered with the chat template as the trainer renders them,
    each answered num_generations times (the dataloader batches answers)."""
    from core.data.grpo import build_grpo_datasets

    g = spec.training.grpo
    assert g is not None
    data = build_grpo_datasets(spec, train_path, eval_path, max_decompressed_bytes)
    prompt_tokens = sum(
        len(tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
        for e in data.train.examples
    )
    answers = len(data.train.examples) * g.num_generations
    generated = answers * g.max_completion_length
    return TokenCount(
        rows=data.train.stats.rows,
        examples=len(data.train.examples),
        batch_rows=answers,
        tokens=prompt_tokens * g.num_generations + generated,
        loss_tokens=generated,
        truncated=0,
        dropped=0,
        eval_examples=len(data.eval.examples) if data.eval is not None else 0,
        generated_tokens=generated,
    )


def optimizer_steps(batch_rows: int, spec: JobSpec) -> tuple[int, int]:
    """(total steps, steps per epoch) as transformers' Trainer computes them: each rank
    batches ceil(rows / world) rows (the distributed sampler pads to equal shares), an epoch
    is ceil(batches / accumulation) optimizer steps, max_steps > 0 wins over epochs."""
    t = spec.training
    world = spec.distributed.processes
    batches = math.ceil(math.ceil(batch_rows / world) / t.per_device_train_batch_size)
    per_epoch = max(math.ceil(batches / t.gradient_accumulation_steps), 1)
    if t.max_steps > 0:
        return t.max_steps, per_epoch
    return math.ceil(t.num_train_epochs * per_epoch), per_epoch


def count_rows(path: Path) -> int | None:
    """Rows of the data at ``path`` (a file or a folder of them), without tokenizing: what
    the step count starts from when tokens cannot be counted; None when unreadable."""
    from core.data.files import inspect_file
    from core.data.reading import DataFileError, data_files

    try:
        return sum(inspect_file(f).rows for f in data_files(path))
    except (OSError, DataFileError):
        return None
