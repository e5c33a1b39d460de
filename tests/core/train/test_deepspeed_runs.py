"""DeepSpeed for real on two CPU processes: ``accelerate launch`` of core.train with the
YAML from ``accelerate_config(spec, device="cpu")`` and the env from ``launch_env``, exactly
as the worker starts a job (worker/run/prepare.py).

* ZeRO-2 with the optimizer offloaded to CPU, and ZeRO-3 with optimizer and parameters
  offloaded, on the tiny Llama with LoRA: the strategy, stage and offload in effect, the
  checkpoints in DeepSpeed's own (per-rank partitioned) format, and a final adapter that is
  consolidated, loadable with PeftModel.from_pretrained and equal to the weights DeepSpeed's
  zero_to_fp32 reconstructs from the last checkpoint's partitions.
* A run stopped gracefully (STOP file) and resumed from its ZeRO-3 checkpoint continues the
  step count and the loss curve of an uninterrupted run.

The first DeepSpeed run on a machine compiles the cpu_adam op (DeepSpeedCPUAdam, which
accelerate puts in place of torch's AdamW when the optimizer is offloaded): ~100 s on a fast
machine, ~290 s on a 2-core one; cached in the venv afterwards (testkit/build_ops.py). The
``cpu_adam`` fixture (conftest.py) builds it once, outside any run's timeout, and the shared-memory
collectives op (deepspeed_shm_comm) beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.utils.deepspeed_runs import LORA, STEPS, Z2_CPU, ds_job
from tests.utils.jobdirs import (
    HAS_DEEPSPEED,
    events,
    launch,
    launch_and_stop,
    losses,
    of_type,
    resume,
    write_launch_files,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    # The first test on a fresh machine also waits for the cpu_adam build (see above).
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (extra: deepspeed)"),
]


def check_adapter_is_consolidated(job: Path, model: Path, checkpoint: Path) -> None:
    """The final adapter: loadable, no empty tensor, equal to DeepSpeed's own fp32
    reconstruction of the partitioned checkpoint at the same step."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from peft import PeftModel
    from peft.utils import load_peft_weights
    from transformers import AutoModelForCausalLM

    saved = load_peft_weights(str(job / "adapter"), device="cpu")
    assert saved and all(t.numel() > 0 for t in saved.values())
    assert any(bool(t.any()) for n, t in saved.items() if "lora_B" in n)  # trained
    zero = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    lora = {k.replace(".default.", "."): v for k, v in zero.items() if "lora_" in k}
    assert set(lora) == set(saved)
    for name, t in saved.items():
        assert torch.equal(t, lora[name].detach().to(t.dtype)), name
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), job / "adapter")


def check_memory_per_rank(evs: list[dict[str, Any]]) -> None:
    mem = of_type(evs, "memory")
    assert {(m["phase"], m["rank"]) for m in mem} == {
        (p, r) for p in ("load", "train", "save") for r in (0, 1)
    }
    for m in mem:
        assert 0 < m["cpu_mb_begin"] <= m["cpu_mb_peak"] and m["cpu_mb_end"] <= m["cpu_mb_peak"]


HIDDEN = 64  # the tiny Llama's hidden size


def check_buckets_sized_to_the_model(evs: list[dict[str, Any]], zero_stage: int) -> None:
    """ZeRO's buckets follow the model (hidden^2), not DeepSpeed's 5e8-element default
    (1.9 GB per rank in float32 whatever the model)."""
    (train,) = [m for m in of_type(evs, "memory") if m["phase"] == "train" and m["rank"] == 0]
    assert train["zero_reduce_bucket_size"] == HIDDEN * HIDDEN
    if zero_stage == 3:
        assert train["zero_prefetch_bucket_size"] == int(0.9 * HIDDEN * HIDDEN)
        assert train["zero_param_persistence_threshold"] == 10 * HIDDEN


def test_zero2_cpu_optimizer_offload_lora(
    cpu_adam: float, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    job = ds_job(tmp_path, tiny_causal_lm, 2, LORA, zero=Z2_CPU)
    _, env = write_launch_files(job)
    assert env["DS_ACCELERATOR"] == "cpu" and "ACCELERATE_USE_CPU" not in env
    launch(job)

    evs = events(job)
    (started,) = of_type(evs, "started")
    assert (started["strategy"], started["distributed_type"], started["world_size"]) == (
        "deepspeed",
        "DEEPSPEED",
        2,
    )
    assert started["zero_stage"] == 2
    assert started["offload_optimizer_device"] == "cpu"
    assert started["offload_param_device"] == "none"
    assert started["process_group_backend"] == "gloo"
    assert [e["step"] for e in of_type(evs, "progress")] == list(range(1, STEPS + 1))
    # DeepSpeed's own format: ZeRO-2 partitions the optimizer state, one file per rank.
    ckpt = job / "checkpoints" / f"checkpoint-{STEPS}"
    names = {p.name for p in (ckpt / f"global_step{STEPS}").iterdir()}
    assert {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= names
    check_adapter_is_consolidated(job, tiny_causal_lm, ckpt)
    check_memory_per_rank(evs)
    check_buckets_sized_to_the_model(evs, zero_stage=2)


def test_zero3_cpu_optimizer_and_param_offload_lora(
    zero3_lora_two: Path, tiny_causal_lm: Path
) -> None:
    """The run is tests/utils/deepspeed_runs.py's, shared with test_deepspeed_checkpoint_runs.py."""
    job = zero3_lora_two
    evs = events(job)
    (started,) = of_type(evs, "started")
    assert (started["strategy"], started["world_size"], started["zero_stage"]) == (
        "deepspeed",
        2,
        3,
    )
    assert started["offload_optimizer_device"] == started["offload_param_device"] == "cpu"
    # TrainingArguments existed before from_pretrained: the base weights were created
    # partitioned (zero.Init), never whole on each rank.
    assert started["zero3_init"] is True and started["params_partitioned_at_load"] is True
    assert started["trainable_params"] == 1792  # counted through ds_numel, not the 0-size stubs
    assert [e["step"] for e in of_type(evs, "progress")] == list(range(1, STEPS + 1))
    ckpt = job / "checkpoints" / f"checkpoint-{STEPS}"
    names = {p.name for p in (ckpt / f"global_step{STEPS}").iterdir()}
    assert {
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
        for r in (0, 1)
        for kind in ("model", "optim")
    } <= names
    check_adapter_is_consolidated(job, tiny_causal_lm, ckpt)
    check_memory_per_rank(evs)
    check_buckets_sized_to_the_model(evs, zero_stage=3)
    (finished,) = of_type(evs, "finished")
    assert finished["step"] == STEPS


def test_resume_from_a_zero3_checkpoint_continues_steps_and_loss(
    zero3_lora_two: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    want = losses(events(zero3_lora_two))
    assert sorted(want) == list(range(1, STEPS + 1))

    job = ds_job(tmp_path, tiny_causal_lm, 2, LORA)
    k = launch_and_stop(job, at_step=2, log=tmp_path / "first-attempt.log")
    assert 2 <= k < STEPS, f"stopped at step {k}: too late to test a resume"
    ckpt = job / "checkpoints" / f"checkpoint-{k}"
    assert (ckpt / f"global_step{k}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    assert not (job / "adapter").exists()
    first = losses(events(job))
    for step in range(1, k + 1):  # same run up to the stop
        if step in first:
            assert first[step] == pytest.approx(want[step], rel=1e-5), step

    resumed = resume(job, ckpt)
    (started,) = of_type(resumed, "started")
    assert started["resumed_from"] == f"checkpoints/checkpoint-{k}"
    steps = [e["step"] for e in of_type(resumed, "progress")]
    assert steps == list(range(k + 1, STEPS + 1)), steps  # the step count continues
    got = losses(resumed)
    # The first resumed step sees the weights, optimizer state (CPU Adam moments, from the
    # partitioned checkpoint), LR schedule and data order of the uninterrupted run.
    assert got[k + 1] == pytest.approx(want[k + 1], rel=1e-4)
    for step in range(k + 1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-3), step
    (finished,) = of_type(resumed, "finished")
    assert finished["step"] == STEPS
    check_adapter_is_consolidated(job, tiny_causal_lm, job / "checkpoints" / f"checkpoint-{STEPS}")
