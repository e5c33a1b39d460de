"""From data files to the datasets the trainer trains on: every row read and checked as at
submit (core/data/files.py), the evaluation split, class labels, tokenizing
(core/data/tokenize.py) and packing (core/data/packing.py).

Everything is tokenized once, in memory, on every rank (each rank then reads its own shard
through the Trainer's distributed sampler). With ``dataset.packing`` the causal-LM training
examples are then packed into rows of up to max_seq_length tokens (core/data/packing.py:
per-example positions and attention, so packing changes the speed, not the model); the
evaluation examples stay one per row, so eval loss means the same with and without packing.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.data.consistency import eval_format_problem, label_problems
from core.data.files import DataProblem, check_rows
from core.data.formats import Receipt, allowed_formats
from core.data.packing import pack_examples
from core.data.reading import DataFileError, iter_rows
from core.data.tokenize import MAX_SHOWN, DataStats, Tokenize, TokenizedDataset
from core.infra.errors import invalid_dataset, invalid_spec
from core.spec import DatasetSpec, JobSpec


@dataclass
class Datasets:
    train: TokenizedDataset
    eval: TokenizedDataset | None
    labels: list[str] | None  # seq_cls: id -> name
    receipt: Receipt | None = None  # what was read from the training data (core/data/formats)


@dataclass
class Checked:
    """A data file's examples in the internal layout of its format (core/data/formats), after
    the same check the API ran at submit (core.data.files.check_rows)."""

    examples: list[Any]
    rows: list[int]  # 1-based file row of each example
    format: str
    labels: list[str]
    receipt: Receipt


def read_checked(
    path: Path, spec: JobSpec, what: str, max_decompressed_bytes: int | None
) -> Checked:
    """Check every row and keep each as the converter the check resolved made it, so the
    trainer reports the same row/field problems if the file changed or the run is by hand."""
    ds = spec.dataset
    if not path.exists():
        raise invalid_dataset(f"{what} data {path} does not exist")
    allowed = allowed_formats(spec.model.task, spec.training.objective)
    kept: list[tuple[int, Any]] = []
    report = check_rows(
        path, ds, allowed=allowed, max_decompressed_bytes=max_decompressed_bytes, keep=kept
    )
    if report.problem_count or report.resolution is None or report.receipt is None:
        shown = "; ".join(str(p) for p in report.problems[:MAX_SHOWN])
        more = report.problem_count - min(report.problem_count, MAX_SHOWN)
        tail = f" (and {more} more)" if more > 0 else ""
        raise invalid_dataset(
            f"{what} data {path.name} does not fit dataset.format {ds.format}: "
            f"{report.problem_count} problem(s): {shown}{tail}"
        )
    # Every row converted (no problem was found): the examples are those of the check.
    rows = [row for row, _ in kept]
    examples = [example for _, example in kept]
    return Checked(examples, rows, report.resolution.layout.format, report.labels, report.receipt)


def read_checked_rows(
    path: Path,
    ds: DatasetSpec,
    what: str,
    max_decompressed_bytes: int | None,
    row_check: Callable[[dict[str, Any]], list[DataProblem]],
) -> tuple[list[dict[str, Any]], list[str]]:
    """All rows of a file as stored, after ``row_check`` (grpo: the objective decides what
    a row is, core/data/grpo.py) passed every one; the same check as at submit."""
    if not path.exists():
        raise invalid_dataset(f"{what} data {path} does not exist")
    report = check_rows(
        path, ds, max_decompressed_bytes=max_decompressed_bytes, row_check=row_check
    )
    if report.problem_count:
        shown = "; ".join(str(p) for p in report.problems[:MAX_SHOWN])
        more = report.problem_count - min(report.problem_count, MAX_SHOWN)
        tail = f" (and {more} more)" if more > 0 else ""
        raise invalid_dataset(
            f"{what} data {path.name}: {report.problem_count} problem(s): {shown}{tail}"
        )
    try:
        rows = list(iter_rows(path, max_decompressed_bytes=max_decompressed_bytes))
    except DataFileError as e:
        raise invalid_dataset(f"{what} data {path.name}: {e}") from e
    return rows, report.labels


def split_for_eval(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, eval) row indices: the same seed gives the same split on every
    rank and on every resume, so no eval row ever leaks into training."""
    k = max(1, round(n * fraction))
    if n - k < 1:
        raise invalid_dataset(
            f"dataset.eval_split {fraction} of {n} rows leaves no rows to train on"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[k:]), sorted(order[:k])


def sorted_labels(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    # Integer labels sort as numbers so that "0".."10" keep their own value as id.
    if names and all(re.fullmatch(r"-?\d+", n) for n in names):
        return sorted(names, key=int)
    return sorted(names)


def build_datasets(
    spec: JobSpec,
    train_path: Path,
    eval_path: Path | None,
    tokenizer: Any,
    max_decompressed_bytes: int | None = None,
) -> Datasets:
    """``max_decompressed_bytes``: the operator's bound on what gzip data may expand to
    (the worker passes settings.max_decompressed_bytes; None: core.data.files' default)."""
    ds = spec.dataset
    checked = read_checked(train_path, spec, "training", max_decompressed_bytes)
    rows, numbers, fmt = checked.examples, checked.rows, checked.format
    eval_rows: list[Any] = []
    eval_numbers: list[int] = []
    if eval_path is not None:
        ev_checked = read_checked(eval_path, spec, "evaluation", max_decompressed_bytes)
        if (mismatch := eval_format_problem(fmt, ev_checked.format)) is not None:
            raise invalid_dataset(mismatch)
        eval_rows, eval_numbers = ev_checked.examples, ev_checked.rows
    elif ds.eval_split > 0:
        tr, ev = split_for_eval(len(rows), ds.eval_split, spec.training.seed)
        eval_rows, eval_numbers = [rows[i] for i in ev], [numbers[i] for i in ev]
        rows, numbers = [rows[i] for i in tr], [numbers[i] for i in tr]

    labels: list[str] | None = None
    label2id: dict[str, int] | None = None
    if spec.model.task == "seq_cls":
        labels = sorted_labels(checked.labels)
        want = spec.model.num_labels
        for param, message in label_problems(labels, num_labels=want,
                                             class_weights=spec.training.class_weights):
            failure = invalid_spec if param == "training.class_weights" else invalid_dataset
            raise failure(f"{param}: {message}")
        if want is not None:
            # Ids without a name in the data still exist in the head; name them generically.
            labels = labels + [f"LABEL_{i}" for i in range(len(labels), want)]
        if len(labels) < 2:
            raise invalid_dataset("classification needs at least 2 distinct labels in the data")
        label2id = {name: i for i, name in enumerate(labels)}

    tokenize = Tokenize(spec, tokenizer, label2id)
    train = tokenize(rows, numbers, fmt)
    _rows_without_loss("training", train.stats, ds, checked.receipt)
    if len(train) == 0:
        raise invalid_dataset(_empty_message("training", train.stats, ds))
    if ds.packing:
        # Packed once, here, identically on every rank: the row count (and so total_steps)
        # is known before training starts.
        packed = pack_examples(train.examples, ds.max_seq_length)
        train.stats.packed_rows = len(packed)
        train = TokenizedDataset(packed, train.stats)
    evaluation = None
    if eval_rows:
        evaluation = tokenize(eval_rows, eval_numbers, fmt)
        _rows_without_loss("evaluation", evaluation.stats, ds, None)
        if len(evaluation) == 0:
            raise invalid_dataset(_empty_message("evaluation", evaluation.stats, ds))
    return Datasets(train=train, eval=evaluation, labels=labels, receipt=checked.receipt)


def _rows_without_loss(
    what: str, st: DataStats, ds: DatasetSpec, receipt: Receipt | None
) -> None:
    """Rows whose rendering has no token to learn: refused (a job that trains on nothing
    must not report success), or skipped and counted with dataset.skip_rows_without_loss."""
    if not st.no_loss:
        return
    rows = ", ".join(map(str, st.no_loss_rows)) + (", ..." if st.no_loss > MAX_SHOWN else "")
    if not ds.skip_rows_without_loss:
        raise invalid_dataset(
            f"{st.no_loss} {what} row(s) have no token to learn once rendered (rows {rows}): "
            "the chat template drops their assistant text, or every turn has weight 0. Fix "
            "the rows or dataset.chat_template, or set dataset.skip_rows_without_loss"
        )
    if receipt is not None:
        receipt.rows_skipped = st.no_loss
        receipt.skipped_rows = list(st.no_loss_rows)


def _empty_message(what: str, st: DataStats, ds: DatasetSpec) -> str:
    rows = ", ".join(str(r) for r in st.dropped_rows)
    return (
        f"no {what} example is left after tokenization: all {st.rows} rows were dropped "
        f"because no token to learn from remains within dataset.max_seq_length "
        f"{ds.max_seq_length} (e.g. rows {rows}); raise max_seq_length or shorten the prompts"
    )
