"""What the training data, the evaluation data and the spec must agree on: one data format
for both files, and (classification) the labels the spec and the eval data name. Checked at
submit from the files' reports (api/services/jobs/submit_checks.py) and again by the trainer
from the rows it read (core/data/datasets.py), with the same words. Torch-free."""

from __future__ import annotations

from collections.abc import Collection, Iterable


def eval_format_problem(train_format: str, eval_format: str) -> str | None:
    """Why the eval data cannot be read in the training data's format, or None."""
    if train_format == eval_format:
        return None
    return (f"the eval data is {eval_format}, the training data {train_format}: give both in "
            "one format (or name it in dataset.format)")


def label_problems(
    labels: Collection[str],
    eval_labels: Iterable[str] = (),
    num_labels: int | None = None,
    class_weights: Iterable[str] | None = None,
) -> list[tuple[str, str]]:
    """(param, message) for each disagreement between the training data's ``labels`` and the
    eval data's labels, model.num_labels and training.class_weights."""
    out: list[tuple[str, str]] = []
    unknown = sorted(set(eval_labels) - set(labels))
    if unknown:
        out.append(("dataset.label_field",
                    f"eval data has labels not in the training data: {', '.join(unknown[:10])}"))
    if num_labels is not None and len(labels) > num_labels:
        out.append(("model.num_labels",
                    f"the data has {len(labels)} labels, more than num_labels {num_labels}"))
    unknown = sorted(set(class_weights or ()) - set(labels)) if labels else []
    if unknown:
        out.append(("training.class_weights", f"labels not in the data: {', '.join(unknown[:10])}"))
    return out
