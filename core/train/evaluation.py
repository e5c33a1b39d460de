"""Evaluation beyond the loss: classification metrics, and classification by generation.

* seq_cls: accuracy and macro-F1 from the head's logits (``classification_metrics``, the
  Trainer's compute_metrics).
* seq2seq_lm, and causal_lm on prompt_completion data, whose eval targets form a small label
  set (a few distinct strings repeated, as in PEFT's twitter-complaints example): the model
  *generates* an answer for each eval input, greedily, and the normalised answer is compared
  with the target (``GenerationEval``). Eval loss says how likely the right answer is; this
  says how often the model actually produces it.

Generation is bounded: at most ``MAX_GENERATED`` eval examples, and max_new_tokens is the
longest label's token count + 2 (a few tokens to spare; a correct answer never needs more).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.data.packing import IGNORE_INDEX

MAX_LABELS = 20  # more distinct targets than this: free-form text, not a label set
MAX_GENERATED = 200  # eval examples generated for, per evaluation
MAX_SAMPLES = 5  # {input, prediction, label} triples reported in the eval event
_SAMPLE_CHARS = 500


def normalise(text: str) -> str:
    """Case, surrounding and repeated whitespace do not make an answer wrong."""
    return re.sub(r"\s+", " ", text).strip().lower()


def macro_f1(predictions: Sequence[Any], labels: Sequence[Any], classes: Sequence[Any]) -> float:
    """Unweighted mean over ``classes`` of per-class F1 (a prediction outside the classes is
    simply wrong: a false negative for the true class, a false positive for none)."""
    scores = []
    for c in classes:
        tp = sum(1 for p, y in zip(predictions, labels) if p == c and y == c)
        fp = sum(1 for p, y in zip(predictions, labels) if p == c and y != c)
        fn = sum(1 for p, y in zip(predictions, labels) if p != c and y == c)
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return sum(scores) / len(scores) if scores else 0.0


def classification_metrics(pred: Any) -> dict[str, float]:
    """Trainer compute_metrics for seq_cls: accuracy and macro-F1 over the label ids."""
    import numpy as np

    logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    predicted = np.argmax(logits, axis=-1)
    labels = pred.label_ids
    classes = range(int(logits.shape[-1]))
    return {
        "accuracy": float((predicted == labels).mean()),
        "f1": macro_f1(predicted.tolist(), labels.tolist(), list(classes)),
    }


@dataclass
class _Item:
    prompt: list[int]  # what the model is given
    target: str  # normalised label text


class GenerationEval:
    """Greedy generation over (a bounded part of) the eval set, scored against a label set."""

    def __init__(
        self, items: list[_Item], labels: list[str], max_new_tokens: int, tokenizer: Any
    ) -> None:
        self.items = items
        self.labels = labels
        self.max_new_tokens = max_new_tokens
        self.tok = tokenizer

    @classmethod
    def build(
        cls, task: str, fmt: str, eval_examples: Sequence[dict[str, Any]], tokenizer: Any
    ) -> GenerationEval | None:
        """None unless the task/format has one target per example and the eval targets form
        a small label set (at most MAX_LABELS distinct strings, and fewer than examples)."""
        if not (task == "seq2seq_lm" or (task == "causal_lm" and fmt == "prompt_completion")):
            return None
        items: list[_Item] = []
        label_tokens = 0
        for ex in eval_examples:
            ids, labels = ex["input_ids"], ex["labels"]
            if task == "seq2seq_lm":
                prompt, target_ids = list(ids), [t for t in labels if t != IGNORE_INDEX]
            else:
                # The completion starts at the first label that carries a loss.
                start = next((i for i, t in enumerate(labels) if t != IGNORE_INDEX), len(labels))
                prompt, target_ids = list(ids[:start]), list(ids[start:])
            if not prompt:
                continue
            target = normalise(tokenizer.decode(target_ids, skip_special_tokens=True))
            label_tokens = max(label_tokens, len(target_ids))
            items.append(_Item(prompt, target))
        distinct = sorted({it.target for it in items})
        if not items or len(distinct) > MAX_LABELS or len(distinct) >= len(items):
            return None
        return cls(items[:MAX_GENERATED], distinct, label_tokens + 2, tokenizer)

    @torch.no_grad()
    def run(self, model: Any, batch_size: int, device: Any) -> tuple[dict[str, float], list[dict]]:
        """(metrics, samples). ``model`` is the unwrapped PeftModel; it is put back in train
        mode by the Trainer at the next training step."""
        was_training = model.training
        model.eval()
        predictions: list[str] = []
        try:
            for i in range(0, len(self.items), batch_size):
                predictions += self._generate(model, self.items[i : i + batch_size], device)
        finally:
            model.train(was_training)
        targets = [it.target for it in self.items]
        correct = [p == t for p, t in zip(predictions, targets)]
        metrics = {
            "accuracy": sum(correct) / len(correct),
            "f1": macro_f1(predictions, targets, self.labels),
            "generated": float(len(predictions)),
        }
        samples = [
            {
                "input": self.tok.decode(it.prompt, skip_special_tokens=True)[-_SAMPLE_CHARS:],
                "prediction": p[:_SAMPLE_CHARS],
                "label": it.target,
            }
            for it, p in list(zip(self.items, predictions))[:MAX_SAMPLES]
        ]
        return metrics, samples

    def _generate(self, model: Any, items: list[_Item], device: Any) -> list[str]:
        pad = self.tok.pad_token_id
        width = max(len(it.prompt) for it in items)
        encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        # A decoder continues from the end of its prompt, so prompts are padded on the left;
        # an encoder reads its input whole, and is padded on the right as in training.
        rows, masks = [], []
        for it in items:
            fill = [pad] * (width - len(it.prompt))
            ones, zeros = [1] * len(it.prompt), [0] * len(fill)
            rows.append(it.prompt + fill if encoder_decoder else fill + it.prompt)
            masks.append(ones + zeros if encoder_decoder else zeros + ones)
        input_ids = torch.tensor(rows, device=device)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.tensor(masks, device=device),
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            pad_token_id=pad,
            eos_token_id=self.tok.eos_token_id,
        )
        new = out if encoder_decoder else out[:, input_ids.shape[1] :]
        return [normalise(t) for t in self.tok.batch_decode(new, skip_special_tokens=True)]
