"""Verification of the saved adapter (adapter_invalid)."""

from __future__ import annotations

import torch

from core.train.adapter import AdapterReference, verify_adapter

A = "base_model.model.layers.0.q_proj.lora_A.weight"
B = "base_model.model.layers.0.q_proj.lora_B.weight"


def _ref() -> AdapterReference:
    return AdapterReference(
        shapes={A: (4, 64), B: (64, 4)},
        initial={A: torch.ones(4, 64), B: torch.zeros(64, 4)},
    )


def _trained() -> dict[str, torch.Tensor]:
    return {A: torch.ones(4, 64), B: torch.full((64, 4), 0.01)}


def test_trained_adapter_passes() -> None:
    assert verify_adapter(_trained(), _ref(), _trained(), "LORA") == []


def test_untrained_lora_b_is_reported() -> None:
    saved = {A: torch.ones(4, 64), B: torch.zeros(64, 4)}
    (problem,) = verify_adapter(saved, _ref(), None, "LORA")
    assert "lora_B" in problem and "all zero" in problem


def test_missing_tensor_and_wrong_shape_are_reported() -> None:
    saved = {A: torch.ones(4, 32)}
    problems = verify_adapter(saved, _ref(), None, "LORA")
    assert any("missing" in p and B in p for p in problems)
    assert any("shape (4, 32), expected (4, 64)" in p for p in problems)


def test_non_finite_values_are_reported() -> None:
    saved = _trained()
    saved[A][0, 0] = float("nan")
    assert any("non-finite" in p for p in verify_adapter(saved, _ref(), None, "LORA"))


def test_file_differing_from_trained_weights_is_reported() -> None:
    trained = _trained()
    trained[B] = trained[B] * 2
    problems = verify_adapter(_trained(), _ref(), trained, "LORA")
    assert any("differs from the trained weights" in p for p in problems)


def test_unchanged_prompt_embeddings_are_reported() -> None:
    ref = AdapterReference({"prompt_embeddings": (4, 64)}, {"prompt_embeddings": torch.ones(4, 64)})
    problems = verify_adapter({"prompt_embeddings": torch.ones(4, 64)}, ref, None, "PROMPT_TUNING")
    assert any("training changed nothing" in p for p in problems)
