"""Batching: the collator that pads tokenized examples (or packed rows) into the tensors
the model takes."""

from __future__ import annotations

from typing import Any

import torch

from core.data.packing import Layout, collate_packed
from core.data.tokenize import IGNORE_INDEX


class PadCollator:
    """Right-pads a batch to its longest example (dynamic padding: no compute spent on a
    global max length). Pads input_ids with the pad token, attention_mask with 0 (so the
    pads are invisible to attention) and LM labels with -100 (so they carry no loss).

    Packed rows (they carry ``position_ids``) are collated by packing.collate_packed in the
    given layout; the Trainer turns that batch into model inputs (packing.model_inputs).
    """

    def __init__(
        self, pad_token_id: int, pad_to_multiple_of: int | None = None, layout: Layout = "mask"
    ) -> None:
        self.pad_id = pad_token_id
        self.multiple = pad_to_multiple_of
        self.layout = layout

    def _width(self, seqs: list[list[int]]) -> int:
        n = max(len(s) for s in seqs)
        if self.multiple:
            n = -(-n // self.multiple) * self.multiple
        return n

    def _pad(self, seqs: list[list[int]], value: int) -> torch.Tensor:
        n = self._width(seqs)
        return torch.tensor([s + [value] * (n - len(s)) for s in seqs], dtype=torch.long)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "position_ids" in features[0]:
            return collate_packed(features, self.pad_id, self.layout, self.multiple)
        ids = [f["input_ids"] for f in features]
        batch = {
            "input_ids": self._pad(ids, self.pad_id),
            "attention_mask": self._pad([[1] * len(s) for s in ids], 0),
        }
        labels = [f["labels"] for f in features]
        if isinstance(labels[0], int):  # seq_cls: one class id per example
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        else:
            batch["labels"] = self._pad(labels, IGNORE_INDEX)
        return batch
