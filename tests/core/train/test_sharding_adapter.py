"""The final adapter under sharding: verification catches the ZeRO-3 pitfall (empty LoRA
tensors from save_pretrained on a partitioned model) before anything is published, and the
adapter reference keeps real shapes when the model is partitioned."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from core.infra.errors import ErrorCode, TrainFailure
from core.train.adapter import (
    AdapterReference,
    _real_shape,
    save_final_adapter,
    verify_adapter,
)

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
SHAPES = {A: (4, 64), B: (64, 4)}


def placeholder(shape: tuple[int, ...]) -> torch.Tensor:
    """What a rank holds for a ZeRO-3 partitioned parameter: 0 elements, real shape aside."""
    t = torch.empty(0)
    t.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
    return t


def test_partitioned_parameters_keep_their_real_shape_in_the_reference() -> None:
    assert _real_shape(placeholder((4, 64))) == (4, 64)
    assert _real_shape(torch.ones(4, 64)) == (4, 64)


def test_empty_lora_tensors_are_reported() -> None:
    """The ZeRO-3 pitfall: every tensor of the file has 0 elements."""
    saved = {A: torch.empty(0), B: torch.empty(0)}
    problems = verify_adapter(saved, AdapterReference(dict(SHAPES)), None, "LORA")
    assert any(A in p and "empty tensor" in p for p in problems)
    assert any(B in p and "empty tensor" in p for p in problems)
    assert any("shape (0,), expected (4, 64)" in p for p in problems)


def test_empty_tensors_are_reported_even_against_an_empty_reference() -> None:
    # If the reference itself was taken from placeholders without ds_shape, shapes match
    # (both empty); the emptiness alone must still fail the adapter.
    saved = {A: torch.empty(0), B: torch.empty(0)}
    ref = AdapterReference({A: (0,), B: (0,)})
    problems = verify_adapter(saved, ref, None, "LORA")
    assert sum("empty tensor" in p for p in problems) == 2


class _FakeTrainer:
    """Just enough of a Trainer for save_final_adapter: save_model writes what
    save_pretrained writes from a ZeRO-3 partitioned PEFT model."""

    is_fsdp_enabled = False
    is_deepspeed_enabled = True

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        peft_model = SimpleNamespace(
            peft_config={"default": SimpleNamespace(peft_type=SimpleNamespace(value="LORA"))}
        )
        self.model = peft_model
        self.model_wrapped = torch.nn.Module()  # what the engine wraps: no FSDP1 unit in it
        self.accelerator = SimpleNamespace(
            wait_for_everyone=lambda: None, unwrap_model=lambda m: peft_model
        )

    def save_model(self, out: str) -> None:
        from safetensors.torch import save_file

        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        save_file(
            dict(self.tensors),
            str(path / "adapter_model.safetensors"),
        )


def _save(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Any:
    ref = AdapterReference({k: _real_shape(placeholder(v)) for k, v in SHAPES.items()})
    return save_final_adapter(_FakeTrainer(tensors), tmp_path, ref, None, "# card", sharded=True)


def test_an_adapter_of_empty_tensors_is_never_published(tmp_path: Path) -> None:
    with pytest.raises(TrainFailure) as e:
        _save(tmp_path, {A: torch.empty(0), B: torch.empty(0)})
    assert e.value.code == ErrorCode.adapter_invalid
    assert "empty tensor" in e.value.message
    assert not (tmp_path / "adapter").exists()


def test_a_gathered_adapter_is_published(tmp_path: Path) -> None:
    files = _save(tmp_path, {A: torch.ones(4, 64), B: torch.full((64, 4), 0.01)})
    assert "adapter_model.safetensors" in files and "README.md" in files
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter.tmp").exists()
