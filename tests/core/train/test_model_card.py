"""The model card of a final adapter (core/train/model_card.py)."""

from __future__ import annotations

from core.train.model_card import model_card


def test_model_card_for_classification_lists_labels_and_loading() -> None:
    card = model_card(
        title="t",
        base_model="org/bert",
        revision=None,
        task="seq_cls",
        method={"method": "lora", "r": 8},
        data={"training rows": 10},
        training={"steps": 5},
        results={"final eval loss": 0.5},
        labels=["negative", "positive"],
    )
    assert "base_model: org/bert" in card
    assert "| method | lora (r=8) |" in card
    assert "| 1 | positive |" in card
    assert "AutoModelForSequenceClassification" in card
    assert "PeftModel.from_pretrained(base, adapter)" in card
