"""core/model/estimate.py's activation memory against what autograd really keeps for backward:
a Llama of one and of two decoder layers (hidden 1024, a gated MLP of 2816, GQA 16/2 heads,
sdpa: TinyLlama's proportions), each run forward once on CPU with torch's saved-tensor
hooks counting every stored tensor that is not a weight; the difference is one layer's. The GPU check compares the whole estimate with a real peak on CUDA
(docs/benchmarks.md); this keeps the per-token coefficients honest on every CI run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from cli.demo_assets import tiny_llama_config
from core.model.estimate import estimate
from core.spec import parse_job_spec

TOKENS = 64
VOCAB = 4096


def model_and_config(layers: int, bf16_base: bool) -> tuple[Any, Any]:
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                               num_hidden_layers=layers, num_attention_heads=16,
                               num_key_value_heads=2, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if bf16_base:
        config.dtype = "bfloat16"  # what the estimate reads for dtype auto
        model = get_peft_model(model.to(torch.bfloat16),
                               LoraConfig(r=8, target_modules="all-linear"))
    return model, config


def kept_bytes(model: Any) -> int:
    """Bytes of the distinct storages autograd saves in one forward under bf16 autocast,
    weights and their autocast copies left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # An autocast copy of a weight has no token dimension.
        if storage.data_ptr() not in weights and TOKENS in t.shape:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, VOCAB, (1, TOKENS))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    return sum(kept.values())


def estimated_bytes(method: str, fmt: str, config: Any) -> float:
    spec = parse_job_spec({
        "model": {"name_or_path": "x"},
        "dataset": {"file_id": "file-x", "max_seq_length": TOKENS, "format": fmt},
        "peft": {"method": method, **({"target_modules": "all-linear"} if method == "lora" else {})},
        "training": {"per_device_train_batch_size": 1, "mixed_precision": "bf16"},
    })  # fmt: skip
    return estimate(spec, config=config).gpu_activations_mb * 2**20


def per_layer_kept(bf16_base: bool) -> int:
    one, _ = model_and_config(1, bf16_base)
    two, _ = model_and_config(2, bf16_base)
    return kept_bytes(two) - kept_bytes(one)


def test_lora_activations_per_layer_are_what_autograd_keeps() -> None:
    _, config = model_and_config(2, bf16_base=True)
    # Chat: the fused head, so the estimate is the decoder layers' alone.
    estimated = estimated_bytes("lora", "chat", config) / 2
    kept = per_layer_kept(bf16_base=True)
    assert estimated == pytest.approx(kept, rel=0.1), (estimated, kept)


def test_full_fine_tunings_activations_are_not_below_what_autograd_keeps() -> None:
    # Its fp32 stream's figure is read off CUDA's peak, above what autograd keeps on CPU
    # (core/model/estimate.py): the estimate may be higher, never lower.
    _, config = model_and_config(2, bf16_base=False)
    estimated = estimated_bytes("full", "chat", config) / 2
    kept = per_layer_kept(bf16_base=False)
    assert kept <= estimated <= 1.5 * kept, (estimated, kept)


def test_the_plain_lm_head_adds_its_logits() -> None:
    _, config = model_and_config(2, bf16_base=True)
    extra = estimated_bytes("lora", "text", config) - estimated_bytes("lora", "chat", config)
    assert extra == TOKENS * VOCAB * 12
    # A format still auto may be text: counted as the plain head.
    assert estimated_bytes("lora", "auto", config) == estimated_bytes("lora", "text", config)


@pytest.mark.parametrize(("dtype", "bytes_per_param"), [("auto", 16), ("bfloat16", 8)])
def test_full_fine_tunings_state_follows_whether_it_keeps_fp32_master_weights(
    dtype: str, bytes_per_param: int
) -> None:
    """model.dtype auto under mixed precision: fp32 master weights (core/train/recipe.py),
    16 B a parameter with Adam; model.dtype bfloat16: weights, gradients and moments in bf16,
    8 B (the GPU check's full-bf16 row peaked at what a plain bf16 Trainer did)."""
    _, config = model_and_config(2, bf16_base=False)
    spec = parse_job_spec({
        "model": {"name_or_path": "x", "dtype": dtype},
        "dataset": {"file_id": "file-x", "max_seq_length": TOKENS, "format": "chat"},
        "peft": {"method": "full"},
        "training": {"per_device_train_batch_size": 1, "mixed_precision": "bf16"},
    })  # fmt: skip
    est = estimate(spec, config=config)
    assert est.gpu_state_mb * 2**20 == pytest.approx(est.trainable_params * bytes_per_param)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_full_grpo_with_a_kl_term_counts_the_reference_copy(method: str) -> None:
    _, config = model_and_config(2, bf16_base=False)

    def grpo(beta: float) -> Any:
        return estimate(parse_job_spec({
            "model": {"name_or_path": "x"},
            "dataset": {"file_id": "file-x", "max_seq_length": TOKENS, "format": "chat"},
            "peft": {"method": method},
            "training": {"objective": "grpo", "per_device_train_batch_size": 4,
                         "grpo": {"beta": beta, "num_generations": 4, "grader": {
                             "type": "string_check", "name": "g", "operation": "eq",
                             "input": "{{sample.output_text}}", "reference": "x"}}},
        }), config=config)  # fmt: skip

    extra = (grpo(0.04).gpu_weights_mb - grpo(0.0).gpu_weights_mb) * 2**20
    # A float32 copy of every weight for full; nothing for an adapter (its base is the
    # reference, the adapter disabled).
    expected = grpo(0.0).total_params * 4 if method == "full" else 0
    assert extra == pytest.approx(expected)
