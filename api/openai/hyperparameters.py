"""OpenAI's "auto" hyperparameters, resolved to numbers by documented rules (docs/openai.md),
and the batch split into what the trainer runs.

* n_epochs auto: 3, raised so that at least 100 examples are trained (at most 25 epochs), or
  lowered so that at most 25,000 are (at least 1): the rule of OpenAI's data-preparation
  cookbook.
* batch_size auto: about 0.2% of the training examples, from 1 to 256 (OpenAI's documented
  default).
* learning_rate_multiplier auto: 1.0. The learning rate is the catalog model's base rate
  (``learning_rate``, default 2e-4, a LoRA rate) times the multiplier.
* beta (dpo) auto: 0.1 (TRL's and the DPO paper's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TARGET_EXAMPLES = 100
MAX_TARGET_EXAMPLES = 25_000
DEFAULT_EPOCHS = 3
MAX_AUTO_EPOCHS = 25
MAX_BATCH = 256
# Examples per process per forward pass; the rest of a batch is gradient accumulation.
MAX_MICRO_BATCH = 8
DEFAULT_BETA = 0.1


def auto_n_epochs(rows: int) -> int:
    if rows <= 0:
        return DEFAULT_EPOCHS
    if rows * DEFAULT_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_AUTO_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / rows))
    if rows * DEFAULT_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(1, MAX_TARGET_EXAMPLES // rows)
    return DEFAULT_EPOCHS


def auto_batch_size(rows: int) -> int:
    return max(1, min(MAX_BATCH, round(rows * 0.002)))


@dataclass(frozen=True)
class BatchSplit:
    per_device: int
    accumulation: int

    def effective(self, processes: int) -> int:
        return self.per_device * self.accumulation * processes


def split_batch(batch_size: int, processes: int) -> BatchSplit:
    """A batch of ``batch_size`` examples over ``processes`` ranks: each rank takes its share
    (rounded up) in micro-batches of at most MAX_MICRO_BATCH, accumulated. The micro-batch
    divides the share, so one rank's share is exact."""
    share = math.ceil(batch_size / max(1, processes))
    micro = max(d for d in range(1, min(share, MAX_MICRO_BATCH) + 1) if share % d == 0)
    return BatchSplit(per_device=micro, accumulation=share // micro)


def steps_per_epoch(rows: int, batch_size: int) -> int:
    return max(1, math.ceil(rows / batch_size))
