"""QLoRA sharded on two CPU processes: FSDP2 (the operator's cpu_fsdp2 route) and DeepSpeed
ZeRO-3 over gloo, with the 4-bit weights stored in bfloat16 (bnb_4bit_quant_storage, as
peft's FSDP guide does it). Each shards the quantized base and ends with the same adapter as
a DDP run of the same seed and data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.utils.adapters import assert_same_adapter
from tests.utils.jobdirs import events, launch, losses, make_job, of_type, set_runtime
from tests.utils.tiny import text_rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUANTIZED = {
    "dtype": "bfloat16",
    "quantization": {"load_in": "4bit", "double_quant": True, "quant_storage": "bfloat16"},
}


def qlora_job(root: Path, model: Path, distributed: dict[str, Any], **training: Any) -> Path:
    return make_job(
        root,
        model,
        text_rows(64),
        spec={
            "model": QUANTIZED,
            "training": {"max_steps": 4, "logging_steps": 1, "save_steps": 2, **training},
            "distributed": distributed,
        },
        runtime={"cpu_fsdp2": True},
    )


@pytest.fixture(scope="module")
def ddp_run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = qlora_job(tmp_path_factory.mktemp("ddp"), tiny_causal_lm,
                    {"strategy": "ddp", "num_processes": 2})
    launch(job)
    return job


FSDP2 = {"strategy": "fsdp", "num_processes": 2,
         "fsdp": {"version": 2, "cpu_ram_efficient_loading": False}}


@pytest.fixture(scope="module")
def fsdp_run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = qlora_job(tmp_path_factory.mktemp("fsdp"), tiny_causal_lm, FSDP2, export_merged=True)
    launch(job)
    return job


def test_fsdp2_shards_the_4bit_base_and_trains_the_ddp_adapter(
    ddp_run: Path, fsdp_run: Path
) -> None:
    job = fsdp_run
    (started,) = of_type(events(job), "started")
    assert (started["strategy"], started["quantization"], started["quant_storage"]) == (
        "fsdp", "4bit", "bfloat16")
    # Every parameter, the 4-bit weights included, is a DTensor holding about half.
    assert started["fsdp_unsharded_params"] == 0
    assert 0.45 <= started["fsdp_largest_param_local_fraction"] <= 0.55
    (ddp_started,) = of_type(events(ddp_run), "started")
    assert max(started["param_mb_per_rank"]) < 0.6 * max(ddp_started["param_mb_per_rank"])
    assert_same_adapter(job / "adapter", ddp_run / "adapter")
    assert [e["path"] for e in of_type(events(job), "saved")] == ["adapter", "merged"]


def test_zero3_partitions_the_4bit_base_and_trains_the_ddp_adapter(
    ddp_run: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    ds = {"strategy": "deepspeed", "num_processes": 2,
          "deepspeed": {"zero_stage": 3, "zero3_init_flag": False}}
    job = qlora_job(tmp_path, tiny_causal_lm, ds)
    launch(job)
    (started,) = of_type(events(job), "started")
    assert (started["strategy"], started["zero_stage"], started["quantization"]) == (
        "deepspeed", 3, "4bit")
    (ddp_started,) = of_type(events(ddp_run), "started")
    assert max(started["param_mb_per_rank"]) < 0.6 * max(ddp_started["param_mb_per_rank"])
    assert_same_adapter(job / "adapter", ddp_run / "adapter")


def test_fsdp2_qlora_resumes_from_its_sharded_checkpoint(
    fsdp_run: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    """The adapter and its Adam moments come back from the per-rank DCP shards; the 4-bit
    base is read again. Steps 3-4 repeat the uninterrupted run's losses and adapter."""
    ckpt = fsdp_run / "checkpoints" / "checkpoint-2"
    assert len(list((ckpt / "state").glob("*.distcp"))) == 2
    job = qlora_job(tmp_path, tiny_causal_lm, FSDP2)
    set_runtime(job, resume_from_checkpoint=str(ckpt))
    launch(job)
    (started,) = of_type(events(job), "started")
    assert (started["initial_step"], started["quantization"]) == (2, "4bit")
    want, got = losses(events(fsdp_run)), losses(events(job))
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert_same_adapter(job / "adapter", fsdp_run / "adapter")
