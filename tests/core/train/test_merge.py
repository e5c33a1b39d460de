"""Merged export: base + adapter folded into plain weights give the adapter's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core.spec import SpecError, parse_job_spec
from core.train.merge import main as merge_main
from core.train.merge import merge_adapter
from tests.utils.jobdirs import make_job
from tests.utils.tiny import text_rows


def _adapter(base_dir: Path, out: Path, config: Any) -> Path:
    """A saved adapter whose weights are not the no-op initialisation (as after training)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out


def _logits(model: Any, tok: Any) -> torch.Tensor:
    batch = tok(["the cat sees the dog", "a red bird"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


def _configs() -> dict[str, Any]:
    from peft import IA3Config, LoraConfig

    lora = {"task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "init_lora_weights": False}
    return {
        "lora": LoraConfig(**lora),
        "dora": LoraConfig(**lora, use_dora=True),
        "rslora-all-linear-modules_to_save": LoraConfig(
            **lora, use_rslora=True, target_modules="all-linear", modules_to_save=["lm_head"]
        ),
        "ia3": IA3Config(task_type="CAUSAL_LM", init_ia3_weights=False),
    }


@pytest.mark.parametrize("method", list(_configs()))
def test_merged_logits_equal_the_adapters(
    method: str, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    adapter = _adapter(tiny_causal_lm, tmp_path / "adapter", _configs()[method])
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32)
    files = merge_adapter(base, adapter, tmp_path / "merged", tok, torch.float32)
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert not (tmp_path / "merged.tmp").exists()

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n or "ia3" in n for n, _ in merged.named_parameters())
    fresh = AutoModelForCausalLM.from_pretrained(tiny_causal_lm).eval()
    before = _logits(fresh, tok)
    expected = _logits(PeftModel.from_pretrained(fresh, adapter).eval(), tok)
    assert (expected - before).abs().max() > 1e-3  # the adapter does change the outputs
    assert torch.allclose(_logits(merged, tok), expected, atol=1e-5)


def test_export_from_a_job_directory(tiny_causal_lm: Path, tmp_path: Path) -> None:
    """``python -m core.train.merge <job_dir>`` (what a sharded run starts on rank 0)."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = make_job(
        tmp_path, tiny_causal_lm, text_rows(4), spec={"training": {"export_merged": True}}
    )
    config = LoraConfig(task_type="CAUSAL_LM", r=4, init_lora_weights=False)
    _adapter(tiny_causal_lm, job / "adapter", config)
    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    tok.save_pretrained(job / "adapter")
    assert merge_main([str(job)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(job / "merged").eval()
    assert merged.config.use_cache is True
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_causal_lm), job / "adapter"
    ).eval()
    assert torch.allclose(_logits(merged, tok), _logits(reference, tok), atol=1e-5)
    assert json.loads((job / "merged" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("method", ["prompt_tuning", "prefix_tuning"])
def test_export_merged_with_virtual_tokens_is_refused_by_the_spec(method: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_job_spec(
            {
                "model": {"name_or_path": "/m"},
                "dataset": {"path": "/d.jsonl"},
                "peft": {"method": method},
                "training": {"export_merged": True},
            }
        )
    (problem,) = info.value.problems
    assert problem.to_dict() == {
        "param": "training.export_merged",
        "message": "export_merged needs lora or ia3",
    }


def test_seq2seq_export_from_a_job_directory(tiny_seq2seq_lm: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from core.model.peft import seq2seq_peft_compat

    job = make_job(
        tmp_path,
        tiny_seq2seq_lm,
        text_rows(4),
        spec={"model": {"task": "seq2seq_lm"}, "dataset": {"format": "seq2seq"}},
    )
    base = AutoModelForSeq2SeqLM.from_pretrained(tiny_seq2seq_lm)
    seq2seq_peft_compat(base)
    model = get_peft_model(base, LoraConfig(task_type="SEQ_2_SEQ_LM", init_lora_weights=False))
    model.save_pretrained(job / "adapter")
    tok = AutoTokenizer.from_pretrained(tiny_seq2seq_lm)
    tok.save_pretrained(job / "adapter")
    assert merge_main([str(job)]) == 0

    batch = dict(tok(["the cat sees the dog"], return_tensors="pt"))
    batch["decoder_input_ids"] = torch.tensor([[0, 5, 6]])
    fresh = AutoModelForSeq2SeqLM.from_pretrained(tiny_seq2seq_lm)
    seq2seq_peft_compat(fresh)
    reference = PeftModel.from_pretrained(fresh, job / "adapter").eval()
    merged = AutoModelForSeq2SeqLM.from_pretrained(job / "merged").eval()
    with torch.no_grad():
        assert torch.allclose(merged(**batch).logits, reference(**batch).logits, atol=1e-5)
