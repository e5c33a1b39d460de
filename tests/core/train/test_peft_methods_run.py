"""Each PEFT method trains, and its adapter loads with PeftModel.from_pretrained and changes
the base model's outputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.jobdirs import make_job
from tests.utils.tiny import text_rows

METHODS: dict[str, dict[str, Any]] = {
    "lora-modules_to_save": {"method": "lora", "modules_to_save": ["lm_head"]},
    "dora": {"method": "lora", "use_dora": True},
    "rslora-all-linear": {"method": "lora", "use_rslora": True, "target_modules": "all-linear"},
    "ia3": {"method": "ia3"},
    "prompt_tuning": {"method": "prompt_tuning", "num_virtual_tokens": 4},
    "prefix_tuning": {"method": "prefix_tuning", "num_virtual_tokens": 4},
}


@pytest.mark.parametrize("name", list(METHODS))
def test_adapter_loads_and_changes_outputs(
    name: str, tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(16),
        spec={"training": {"max_steps": 3, "learning_rate": 5e-2}},
    )
    body = json.loads((job / "spec.json").read_text())
    body["spec"]["peft"] = METHODS[name]  # replace, not merge: each method has its own fields
    (job / "spec.json").write_text(json.dumps(body))
    assert run_main(job) == 0

    adapter = job / "adapter"
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    if name == "lora-modules_to_save":
        assert any("lm_head" in k for k in keys)  # trained fully, saved with the adapter
    if name == "rslora-all-linear":
        targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert all(any(f".{t}." in k for k in keys) for t in targets)

    tok = AutoTokenizer.from_pretrained(adapter)
    inputs = tok(["the cat sees the dog"], return_tensors="pt")
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm).eval()
    with torch.no_grad():
        before = base(**inputs).logits[:, -1]
        model = PeftModel.from_pretrained(base, adapter).eval()
        after = model(**inputs).logits[:, -1]  # prompt tuning prepends virtual positions
    assert (after - before).abs().max() > 1e-4
