"""QLoRA for real on CPU (bitsandbytes 0.50.2): the tiny Llama loaded in 4-bit NF4 (and
8-bit), LoRA trained on it through core.train, the adapter loaded on the float32 base, and
the merged export equal to the adapter merged into the float32 base."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.jobdirs import events, make_job, of_type, read_error
from tests.utils.tiny import text_rows

FOUR_BIT = {"load_in": "4bit", "quant_type": "nf4", "double_quant": True}


def qlora_job(root: Path, model: Path, quantization: dict[str, Any], **training: Any) -> Path:
    return make_job(
        root,
        model,
        text_rows(32),
        spec={
            "model": {"quantization": quantization},
            "training": {"max_steps": 4, "learning_rate": 2e-2, **training},
        },
    )


def logits(model: Any, tok: Any) -> torch.Tensor:
    batch = tok(["the cat sees the dog", "a red bird"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


@pytest.fixture(scope="module")
def four_bit_run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import signal

    from core.train.__main__ import main

    job = qlora_job(
        tmp_path_factory.mktemp("qlora"),
        tiny_causal_lm,
        FOUR_BIT,
        gradient_checkpointing=True,
        export_merged=True,
    )
    previous = signal.getsignal(signal.SIGTERM)  # main installs its own
    try:
        assert main([str(job)]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    return job


def test_the_base_was_quantized_as_asked(four_bit_run: Path) -> None:
    (started,) = of_type(events(four_bit_run), "started")
    # Every Linear of the 2 decoder layers (7 each) is 4-bit; the LM head stays full precision.
    assert started["quantization"] == "4bit" and started["quantized_modules"] == 14
    assert (started["quant_type"], started["double_quant"]) == ("nf4", True)
    assert (started["compute_dtype"], started["quant_storage"]) == ("float32", "uint8")
    assert started["gradient_checkpointing"] is True


def test_the_adapter_trained_and_loads_on_the_float32_base(
    four_bit_run: Path, tiny_causal_lm: Path
) -> None:
    from peft import PeftModel
    from peft.utils import load_peft_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = load_peft_weights(str(four_bit_run / "adapter"), device="cpu")
    assert any(bool(t.any()) for n, t in weights.items() if "lora_B" in n)  # it trained
    assert all(t.dtype == torch.float32 for t in weights.values())

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32).eval()
    before = logits(base, tok)
    model = PeftModel.from_pretrained(base, four_bit_run / "adapter").eval()
    assert not any("4bit" in type(m).__name__ for m in model.modules())
    assert (logits(model, tok) - before).abs().max() > 1e-4  # the adapter does something


def test_merged_export_is_the_float32_base_plus_adapter(
    four_bit_run: Path, tiny_causal_lm: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = [e["path"] for e in of_type(events(four_bit_run), "saved")]
    assert saved == ["adapter", "merged"]
    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    merged = AutoModelForCausalLM.from_pretrained(four_bit_run / "merged").eval()
    assert merged.dtype == torch.float32
    assert not any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in merged.modules())
    assert "quantization_config" not in json.loads(
        (four_bit_run / "merged" / "config.json").read_text()
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, four_bit_run / "adapter").merge_and_unload()
    torch.testing.assert_close(logits(merged, tok), logits(expected.eval(), tok), atol=1e-5,
                               rtol=1e-5)


def test_the_card_says_what_base_it_trained_on_and_what_was_merged(four_bit_run: Path) -> None:
    card = (four_bit_run / "adapter" / "README.md").read_text()
    assert "4-bit nf4, compute dtype float32, double quantization" in card
    assert "merged into the full-precision base" in card


def test_eight_bit_trains_on_cpu(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    from peft.utils import load_peft_weights

    job = qlora_job(tmp_path, tiny_causal_lm, {"load_in": "8bit"})
    assert run_main(job) == 0
    (started,) = of_type(events(job), "started")
    assert (started["quantization"], started["quantized_modules"]) == ("8bit", 14)
    weights = load_peft_weights(str(job / "adapter"), device="cpu")
    assert any(bool(t.any()) for n, t in weights.items() if "lora_B" in n)
    assert "8-bit" in (job / "adapter" / "README.md").read_text()


def test_without_bitsandbytes_the_job_fails_before_loading(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import core.policy.hardware

    monkeypatch.setattr(core.policy.hardware, "bitsandbytes_installed", lambda: False)
    job = qlora_job(tmp_path, tiny_causal_lm, FOUR_BIT)
    assert run_main(job) != 0
    err = read_error(job)
    assert err["code"] == "unsupported_hardware"
    assert "model.quantization" in err["message"] and "bitsandbytes" in err["message"]
    assert not of_type(events(job), "started")


def test_a_base_that_is_not_quantized_fails_the_proof(tiny_causal_lm: Path) -> None:
    from transformers import AutoModelForCausalLM

    from core.infra.errors import TrainFailure
    from core.spec import parse_job_spec
    from core.train.model import quantization_in_effect

    spec = parse_job_spec(
        {"model": {"name_or_path": str(tiny_causal_lm), "quantization": FOUR_BIT},
         "dataset": {"path": "/d"}}
    )
    with pytest.raises(TrainFailure) as e:
        quantization_in_effect(AutoModelForCausalLM.from_pretrained(tiny_causal_lm), spec)
    assert e.value.code == "strategy_mismatch" and "Linear4bit" in e.value.message
