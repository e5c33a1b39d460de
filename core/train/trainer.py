"""transformers.Trainer with two small additions: a per-step NaN flag and class weights."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer


class JobTrainer(Trainer):
    """The stock Trainer, plus:

    * ``take_nonfinite()``: whether any micro-batch loss since the last call was NaN/inf.
      The flag stays a device tensor (no host sync inside the step); the callback reads it
      once per optimizer step, together with the stop flag, in one all-reduce.
    * ``class_weights``: seq_cls loss weighted per class (see ``weighted_ce``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._nonfinite: torch.Tensor | None = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        flag = (~torch.isfinite(loss)).any()
        self._nonfinite = flag if self._nonfinite is None else self._nonfinite | flag
        return loss

    def take_nonfinite(self) -> float:
        if self._nonfinite is None:
            return 0.0
        value = float(self._nonfinite.item())
        self._nonfinite = None
        return value


def weighted_ce(weights: torch.Tensor) -> Any:
    """A Trainer ``compute_loss_func`` for class-weighted cross-entropy.

    With gradient accumulation the Trainer passes ``num_items_in_batch``: the number of
    labelled examples in the whole accumulated batch (summed over ranks). Summing the
    per-example losses and dividing by that count makes the accumulated gradient equal to
    the gradient of one big batch, whatever the micro-batch sizes.
    """

    def loss_fn(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        # Cross-entropy in fp32: log-softmax of half-precision logits loses the small
        # probabilities that carry most of the gradient.
        w = weights.to(device=logits.device, dtype=torch.float32)
        per_example = torch.nn.functional.cross_entropy(
            logits.float(), labels, weight=w, reduction="none"
        )
        if num_items_in_batch is None:
            return per_example.mean()
        return per_example.sum() / num_items_in_batch

    return loss_fn
