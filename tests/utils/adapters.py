"""Trained adapters in tests: read one's tensors, compare two, load one on its base (from a
job directory, or downloaded from the service as a user would)."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client import FtuneClient

if TYPE_CHECKING:  # torch is imported where a test uses it, not at collection
    import torch


def adapter(path: Path) -> dict[str, torch.Tensor]:
    from peft.utils import load_peft_weights

    return load_peft_weights(str(path), device="cpu")


def assert_same_adapter(a: Path, b: Path, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """Same tensors, same values (to float rounding: gloo sums in another order than DDP)."""
    import torch

    x, y = adapter(a), adapter(b)
    assert x and set(x) == set(y)
    for name in x:
        assert x[name].shape == y[name].shape, name
        torch.testing.assert_close(x[name], y[name], rtol=rtol, atol=atol, msg=name)
    assert any(bool(t.any()) for n, t in x.items() if "lora_B" in n)  # it trained


def assert_loads(model: Path, path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), path)


def assert_adapter_loads(
    client: FtuneClient,
    job_id: str,
    base: Path,
    tmp: Path,
    auto_cls: Any,
    checkpoint: int | None = None,
) -> None:
    import torch
    from peft import PeftModel

    tmp.mkdir(parents=True, exist_ok=True)
    zpath = client.download_adapter(job_id, tmp / f"{job_id}.zip", checkpoint=checkpoint)
    out = tmp / job_id
    with zipfile.ZipFile(zpath) as z:
        names = set(z.namelist())
        z.extractall(out)
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= names
    assert any(n.startswith("tokenizer") for n in names)
    kwargs = {}
    if (out / "labels.json").exists():
        import json

        kwargs["num_labels"] = len(json.loads((out / "labels.json").read_text())["id2label"])
    from core.model.peft import seq2seq_peft_compat

    base_model = auto_cls.from_pretrained(base, **kwargs)
    seq2seq_peft_compat(base_model)  # peft 0.21 + transformers 5: see the model card
    model = PeftModel.from_pretrained(base_model, out)
    reference = auto_cls.from_pretrained(base, **kwargs)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model.eval()
    reference.eval()
    with torch.no_grad():
        if (
            hasattr(reference.config, "decoder_start_token_id")
            and reference.config.is_encoder_decoder
        ):
            dec = torch.tensor([[reference.config.decoder_start_token_id]])
            a = model(input_ids=ids, decoder_input_ids=dec).logits
            b = reference(input_ids=ids, decoder_input_ids=dec).logits
        else:
            a, b = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert not torch.allclose(a, b), "the adapter does not change the model's output"
