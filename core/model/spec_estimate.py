"""One estimate of a spec for `ftune estimate` (cli/estimate.py) and the dry run (POST
/v1/jobs?dry_run=true, api/services/estimates.py): the training data's tokens and the
optimizer steps they make (core/data/counts.py) where the data and the model's tokenizer are
at hand, and the memory per process (core/model/estimate.py). What could not be worked out
is said in ``notes``, with the reason, and the rest is still estimated."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.data.counts import TokenCount, count_rows, count_tokens, optimizer_steps
from core.infra.errors import TrainFailure
from core.model.estimate import Estimate, estimate
from core.spec import JobSpec


@dataclass
class SpecEstimate:
    count: TokenCount | None = None  # None: tokens not counted (notes say why)
    steps: int | None = None  # from the counted data (memory.steps: from ``rows``)
    epochs: float | None = None
    trained_tokens: int | None = None  # tokens in all the steps, no padding
    memory: Estimate | None = None  # None: not estimated (notes say why)
    notes: list[str] = field(default_factory=list)


def estimate_spec(
    spec: JobSpec,
    model_path: str | None,
    train_path: Path | None = None,
    eval_path: Path | None = None,
    *,
    rows: int | None = None,
    data_format: str | None = None,
    max_decompressed_bytes: int | None = None,
) -> SpecEstimate:
    """``model_path``: the model's directory (its tokenizer and config are read; None: no
    tokens and no memory). ``train_path``: the training data to count (None: not counted).
    ``rows``: the training rows when known, else read from ``train_path`` when its tokens
    cannot be counted: the memory estimate's ``steps`` come from them. ``data_format``: the
    format detected."""
    out = SpecEstimate()
    if model_path is not None and train_path is not None:
        try:
            out.count = count_tokens(spec, model_path, train_path, eval_path,
                                     max_decompressed_bytes)
        except (TrainFailure, OSError, ValueError) as e:  # say why, estimate the rest
            out.notes.append(f"tokens not counted: {e}")
    if out.count is not None:
        out.steps, per_epoch = optimizer_steps(out.count.batch_rows, spec)
        out.epochs = round(out.steps / per_epoch, 4)
        out.trained_tokens = round(out.count.tokens * out.steps / per_epoch)
        if out.count.generated_tokens:
            out.notes.append(
                f"grpo generates up to {out.count.generated_tokens:,} tokens per epoch "
                "(num_generations x max_completion_length per prompt), counted in the "
                "tokens as an upper bound (answers may end earlier)"
            )
    if out.count is None and rows is None and train_path is not None:
        rows = count_rows(train_path)  # the steps, at least, from the rows
    if model_path is not None:
        try:
            out.memory = estimate(spec, model_path, rows=rows, data_format=data_format)
        except (OSError, ValueError) as e:
            out.notes.append(f"memory not estimated: {e}")
    return out
