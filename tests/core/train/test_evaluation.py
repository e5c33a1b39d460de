"""Evaluation metrics: macro-F1, classification metrics, and classification by generation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from core.data.packing import IGNORE_INDEX
from core.train.evaluation import (
    GenerationEval,
    _Item,
    classification_metrics,
    macro_f1,
    normalise,
)
from tests.utils.jobdirs import events, make_job, of_type
from tests.utils.tiny import sentences


def test_macro_f1_averages_classes_equally() -> None:
    preds = ["a", "a", "b", "c"]  # "c" is no class: wrong, and a false positive for none
    gold = ["a", "b", "b", "b"]
    # a: tp 1, fp 1, fn 0 -> 2/3; b: tp 1, fp 0, fn 2 -> 2/4
    assert macro_f1(preds, gold, ["a", "b"]) == pytest.approx((2 / 3 + 1 / 2) / 2)


def test_classification_metrics_from_logits() -> None:
    logits = np.array([[2.0, 0.0], [0.0, 2.0], [3.0, 1.0], [0.0, 1.0]])
    out = classification_metrics(
        SimpleNamespace(predictions=logits, label_ids=np.array([0, 1, 1, 1]))
    )
    assert out["accuracy"] == 0.75
    assert out["f1"] == pytest.approx((2 / 3 + 4 / 5) / 2)


def test_normalise_ignores_case_and_spacing() -> None:
    assert normalise("  No \n Complaint ") == "no complaint"


def _lm_examples(tok: Any, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    out = []
    for p, c in pairs:
        pi, ci = tok(p)["input_ids"], tok(c, add_special_tokens=False)["input_ids"]
        out.append({"input_ids": pi + ci, "labels": [IGNORE_INDEX] * len(pi) + ci})
    return out


def test_generation_eval_only_for_small_label_sets(tiny_causal_lm: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    texts = sentences(30, seed=4)
    labelled = _lm_examples(tok, [(t, " yes" if i % 3 else " no") for i, t in enumerate(texts)])
    ev = GenerationEval.build("causal_lm", "prompt_completion", labelled, tok)
    assert ev is not None and ev.labels == ["no", "yes"]
    assert ev.max_new_tokens == max(len(tok(" yes")["input_ids"]), len(tok(" no")["input_ids"])) + 2
    free_text = _lm_examples(tok, [(t, " " + t) for t in texts])  # every target distinct
    assert GenerationEval.build("causal_lm", "prompt_completion", free_text, tok) is None
    assert GenerationEval.build("causal_lm", "text", labelled, tok) is None


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_batched_generation_matches_one_at_a_time(
    kind: str, tiny_causal_lm: Path, tiny_seq2seq_lm: Path
) -> None:
    """Targets are what the model generates for each prompt alone; generated in one padded
    batch (left padding for a decoder, right for an encoder), every answer must match."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    path = tiny_causal_lm if kind == "causal" else tiny_seq2seq_lm
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSeq2SeqLM
    tok = AutoTokenizer.from_pretrained(path)
    model = cls.from_pretrained(path).eval()
    items = []
    for s in sentences(6, seed=13):
        ids = tok(s)["input_ids"] + ([tok.eos_token_id] if kind == "seq2seq" else [])
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=3,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        new = out[0] if kind == "seq2seq" else out[0, len(ids) :]
        items.append(_Item(ids, normalise(tok.decode(new, skip_special_tokens=True))))
    assert len({len(it.prompt) for it in items}) > 1  # the batch needs padding
    ev = GenerationEval(items, sorted({it.target for it in items}), 3, tok)
    metrics, samples = ev.run(model, batch_size=6, device="cpu")
    assert metrics["accuracy"] == 1.0 and metrics["f1"] == 1.0 and metrics["generated"] == 6
    assert len(samples) == 5 and set(samples[0]) == {"input", "prediction", "label"}


def test_eval_event_reports_generation_accuracy_and_samples(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    """causal_lm on prompt_completion with a two-label target set (as PEFT's
    twitter-complaints example): the eval event carries accuracy, F1 and samples."""

    def rows(n: int, seed: int) -> list[dict[str, str]]:
        return [
            {
                "prompt": s,
                "completion": " complaint" if "sad" in s or "bad" in s else " no complaint",
            }
            for s in sentences(n, seed)
        ]

    job = make_job(
        tmp_path,
        tiny_causal_lm,
        rows(32, 1),
        spec={
            "dataset": {"format": "prompt_completion", "eval_path": "eval.jsonl"},
            "training": {"max_steps": 4, "learning_rate": 2e-2},
        },
        eval_rows=rows(12, 2),
    )
    assert run_main(job) == 0
    evs = events(job)
    (started,) = of_type(evs, "started")
    assert started["generation_eval"] is True
    (e,) = of_type(evs, "eval")
    assert 0.0 <= e["accuracy"] <= 1.0 and 0.0 <= e["f1"] <= 1.0 and e["generated"] == 12
    assert len(e["eval_samples"]) == 5
    assert {s["label"] for s in e["eval_samples"]} <= {"complaint", "no complaint"}
    card = (job / "adapter" / "README.md").read_text()
    assert "| final eval accuracy |" in card and "| final eval accuracy | - |" not in card
