"""Full fine-tuning must fit: Llama 2 70B, built on the meta device from its config (no
weights, no download), against GPUs of 80 GB. The seeds' setup (FSDP FULL_SHARD over 2 nodes
x 8 A100 80GB, bf16, batch 1, 2048 tokens, activation checkpointing) fits; DDP, or FSDP on
one node of 8, cannot, and the refusal says how much it would need."""

from __future__ import annotations

from typing import Any

import pytest

from core.model.estimate import estimate
from core.policy.memory import fleet_memory_refusal, memory_refusal
from core.spec import parse_job_spec
from tests.utils.specs import parsed_spec

A100_80GB = 81_920  # MiB
LLAMA2_70B_PARAMS = 68_976_648_192


@pytest.fixture(scope="module")
def llama2_70b() -> Any:
    from transformers import LlamaConfig

    # meta-llama/Llama-2-70b-hf config.json
    return LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        dtype="float16",
    )


def spec(**distributed: Any) -> Any:
    return parsed_spec("/models/llama-2-70b", dataset={"file_id": "file-x", "max_seq_length": 2048},
                       peft={"method": "full"},
                       training={"per_device_train_batch_size": 1, "mixed_precision": "bf16"},
                       distributed=distributed)


SEEDS = {"strategy": "fsdp", "num_processes": 16, "num_machines": 2,
         "fsdp": {"sharding_strategy": "FULL_SHARD", "activation_checkpointing": True}}


def test_seeds_setup_fits_with_its_per_rank_estimate(llama2_70b: Any) -> None:
    est = estimate(spec(**SEEDS), config=llama2_70b)
    assert est.trainable_params == est.total_params == LLAMA2_70B_PARAMS
    # 16 B per parameter (bf16 weights and gradients, fp32 master weights and Adam moments),
    # split over 16 ranks: about 65,780 MiB each; plus two of the 80 decoder layers gathered
    # whole in bf16 (the one running, the one prefetched): about 3,290 MiB.
    gathered = 2 * LLAMA2_70B_PARAMS / 80 * 2
    assert est.gpu_state_mb == pytest.approx((LLAMA2_70B_PARAMS * 16 / 16 + gathered) / 2**20)
    assert est.gpu_state_mb + est.gpu_activations_mb < A100_80GB
    assert memory_refusal(spec(**SEEDS), est, A100_80GB) is None


def test_ddp_is_refused_with_the_memory_it_would_need(llama2_70b: Any) -> None:
    s = spec(strategy="ddp", num_processes=16, num_machines=2)
    est = estimate(s, config=llama2_70b)
    refusal = memory_refusal(s, est, A100_80GB)
    assert refusal is not None and refusal.param == "distributed.strategy"
    assert f"{LLAMA2_70B_PARAMS * 16 / 2**20:,.0f} MiB per process" in refusal.message
    assert "at least 13 processes" in refusal.message


def test_fsdp_on_one_node_of_eight_is_refused_naming_the_process_count(llama2_70b: Any) -> None:
    s = spec(strategy="fsdp", num_processes=8)
    refusal = memory_refusal(s, estimate(s, config=llama2_70b), A100_80GB)
    assert refusal is not None and refusal.param == "distributed.num_processes"
    assert refusal.message.startswith("8 processes: full fine-tuning holds 134,852 MiB")


def test_unknown_gpu_memory_or_an_adapter_is_never_refused(llama2_70b: Any) -> None:
    s = spec(strategy="ddp", num_processes=2)
    est = estimate(s, config=llama2_70b)
    assert fleet_memory_refusal(s, est, [A100_80GB, 0]) is None  # one worker says nothing
    assert fleet_memory_refusal(s, est, []) is None
    lora = parse_job_spec({**s.model_dump(mode="json", exclude_unset=True),
                           "peft": {"method": "lora"}})
    assert memory_refusal(lora, estimate(lora, config=llama2_70b), A100_80GB) is None
