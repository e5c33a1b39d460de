"""Training rows as the trainer renders them, seen before a GPU is asked for: ``preview``
(each token and whether it carries loss: `ftune estimate --preview`, the estimates API) and
``rows_without_loss`` (what submit refuses)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core.data.files import iter_examples
from core.data.tokenize import IGNORE_INDEX, MAX_SHOWN, TOKENIZE_BATCH, Tokenize
from core.spec import JobSpec


def _examples(path: Path, spec: JobSpec, res: Any, max_decompressed_bytes: int | None,
              limit: int | None = None) -> Iterable[tuple[int, Any]]:
    for row, ex in iter_examples(path, spec.dataset, res,
                                 max_decompressed_bytes=max_decompressed_bytes):
        if limit is not None and row > limit:
            return
        yield row, ex


def preview(
    spec: JobSpec,
    tokenizer: Any,
    path: Path,
    res: Any,
    n: int,
    max_decompressed_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """The first ``n`` rows as the trainer renders them: each token's id and text, and
    whether it carries loss (after truncation at max_seq_length, as trained)."""
    fmt = res.layout.format
    if fmt in ("preference", "kto") or spec.model.task == "seq_cls":
        return []
    got = list(_examples(path, spec, res, max_decompressed_bytes, limit=n))
    if not got:
        return []
    numbers, rows = [r for r, _ in got], [e for _, e in got]
    tokenize = Tokenize(spec, tokenizer, None)
    out: list[dict[str, Any]] = []
    for row, ex in zip(numbers, rows):
        # One row at a time so a row without loss still shows (it is dropped in training).
        kept = tokenize([ex], [row], fmt).examples
        if kept:
            ids, labels = kept[0]["input_ids"], kept[0]["labels"]
        else:
            ids, labels = [], []
        shift = spec.model.task == "causal_lm"
        tokens = [
            {"id": t, "text": tokenizer.decode([t]),
             "loss": bool(l != IGNORE_INDEX and (i > 0 or not shift))}
            for i, (t, l) in enumerate(zip(ids, labels))
        ] if shift else [{"id": t, "text": tokenizer.decode([t]), "loss": False} for t in ids]
        item: dict[str, Any] = {
            "row": row,
            "tokens": tokens,
            "loss_tokens": sum(1 for t in tokens if t["loss"]),
            "kept": bool(kept),
        }
        if spec.model.task == "seq2seq_lm" and kept:
            item["target"] = [{"id": t, "text": tokenizer.decode([t]), "loss": True}
                              for t in labels]
            item["loss_tokens"] = len(labels)
        out.append(item)
    return out


def rows_without_loss(
    spec: JobSpec,
    tokenizer: Any,
    path: Path,
    res: Any,
    max_decompressed_bytes: int | None = None,
    limit: int | None = None,
) -> tuple[int, list[int]]:
    """(count, first rows) of rows whose rendering carries no loss token: what submit
    refuses (or counts, with dataset.skip_rows_without_loss) before a GPU is asked for.
    ``limit``: only the first rows (the trainer checks every row again)."""
    fmt = res.layout.format
    tokenize = Tokenize(spec, tokenizer, None)
    count, first = 0, list[int]()
    batch: list[tuple[int, Any]] = []

    def flush() -> None:
        nonlocal count
        st = tokenize([e for _, e in batch], [r for r, _ in batch], fmt).stats
        count += st.no_loss
        first.extend(st.no_loss_rows[: MAX_SHOWN * 4 - len(first)])
        batch.clear()

    for item in _examples(path, spec, res, max_decompressed_bytes, limit=limit):
        batch.append(item)
        if len(batch) >= TOKENIZE_BATCH:
            flush()
    if batch:
        flush()
    return count, first
