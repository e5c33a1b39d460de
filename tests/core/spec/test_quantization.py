"""model.quantization (QLoRA): its defaults, the peft methods and 4-bit options it takes, its
compute dtype against mixed precision, and what FSDP / DeepSpeed need to shard a quantized
base (each rule with the field to change)."""

from __future__ import annotations

from typing import Any

import pytest

from core.spec import JobSpec, SpecError, parse_job_spec

FOUR_BIT_SHARDABLE = {"load_in": "4bit", "quant_storage": "bfloat16"}


def body(quantization: dict[str, Any], **over: Any) -> dict[str, Any]:
    model = {"name_or_path": "org/tiny", "quantization": quantization, **over.pop("model", {})}
    return {"model": model, "dataset": {"file_id": "file-1"}, **over}


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_job_spec(data)
    return {p.param: p.message for p in e.value.problems}


def test_not_quantized_by_default() -> None:
    spec = parse_job_spec({"model": {"name_or_path": "o/m"}, "dataset": {"file_id": "f"}})
    assert spec.model.quantization is None
    assert spec.model.compute_dtype("bf16") is None


def test_four_bit_defaults_follow_bitsandbytes_config() -> None:
    q = parse_job_spec(body({"load_in": "4bit"})).model.quantization
    assert q is not None
    assert (q.quant_type, q.compute_dtype, q.double_quant, q.quant_storage) == (
        "nf4",
        None,
        False,
        "uint8",
    )


@pytest.mark.parametrize(("mixed", "want"), [("no", "float32"), ("bf16", "bfloat16"),
                                             ("fp16", "float16")])
def test_compute_dtype_follows_mixed_precision_unless_set(mixed: str, want: str) -> None:
    spec = parse_job_spec(body({"load_in": "4bit"}, training={"mixed_precision": mixed}))
    assert spec.model.compute_dtype(mixed) == want
    set_ = parse_job_spec(body({"load_in": "4bit", "compute_dtype": "float32"},
                               training={"mixed_precision": mixed}))
    assert set_.model.compute_dtype(mixed) == "float32"


def test_compute_dtype_contradicting_mixed_precision_is_refused() -> None:
    got = problems(body({"load_in": "4bit", "compute_dtype": "float16"},
                        training={"mixed_precision": "bf16"}))
    assert list(got) == ["model.quantization.compute_dtype"]
    assert "bfloat16" in got["model.quantization.compute_dtype"]


@pytest.mark.parametrize(
    "peft",
    [{"method": "lora", "use_dora": True}, {"method": "lora", "use_rslora": True}, None],
)
def test_lora_family_trains_on_a_quantized_base(peft: dict[str, Any] | None) -> None:
    data = body({"load_in": "4bit", "quant_type": "fp4", "double_quant": True})
    if peft:
        data["peft"] = peft
    assert parse_job_spec(data).model.quantization is not None


@pytest.mark.parametrize("method", ["ia3", "prompt_tuning", "prefix_tuning"])
def test_other_peft_methods_are_refused(method: str) -> None:
    got = problems(body({"load_in": "8bit"}, peft={"method": method}))
    assert list(got) == ["peft.method"] and "lora" in got["peft.method"]


def test_four_bit_options_with_eight_bit_are_refused_each() -> None:
    got = problems(body({"load_in": "8bit", "quant_type": "nf4", "double_quant": True}))
    assert set(got) == {"model.quantization.quant_type", "model.quantization.double_quant"}


def test_unknown_values_and_keys_are_refused() -> None:
    got = problems(body({"load_in": "2bit", "bnb_4bit_quant_type": "nf4"}))
    assert set(got) == {"model.quantization.load_in", "model.quantization.bnb_4bit_quant_type"}


def test_every_quantization_field_is_documented() -> None:
    props = JobSpec.model_json_schema()["$defs"]["QuantizationSpec"]["properties"]
    assert all(p.get("description") for p in props.values())


FSDP2 = {"strategy": "fsdp", "num_processes": 2,
         "fsdp": {"version": 2, "cpu_ram_efficient_loading": False}}


def test_fsdp2_with_a_float_quant_storage_is_accepted() -> None:
    parse_job_spec(body(FOUR_BIT_SHARDABLE, model={"dtype": "bfloat16"}, distributed=FSDP2))


def test_sharding_uint8_4bit_weights_is_refused() -> None:
    for dist in (FSDP2, {"strategy": "deepspeed", "num_processes": 2,
                         "deepspeed": {"zero_stage": 2}}):
        got = problems(body({"load_in": "4bit"}, distributed=dist))
        assert list(got) == ["model.quantization.quant_storage"], dist


def test_sharding_8bit_is_refused() -> None:
    got = problems(body({"load_in": "8bit"}, distributed=FSDP2))
    assert list(got) == ["model.quantization.load_in"]


def test_fsdp_rules_for_a_quantized_base() -> None:
    fsdp1 = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 1}}
    got = problems(body(FOUR_BIT_SHARDABLE, distributed=fsdp1))
    assert "distributed.fsdp.version" in got
    # Ranks that start without weights would build an unquantized model.
    got = problems(body(FOUR_BIT_SHARDABLE,
                        distributed={"strategy": "fsdp", "num_processes": 2}))
    assert list(got) == ["distributed.fsdp.cpu_ram_efficient_loading"]


def test_zero3_needs_zero3_init_off_with_a_quantized_base() -> None:
    ds = {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 3}}
    got = problems(body(FOUR_BIT_SHARDABLE, distributed=ds))
    assert list(got) == ["distributed.deepspeed.zero3_init_flag"]
    ds["deepspeed"] = {"zero_stage": 3, "zero3_init_flag": False}
    parse_job_spec(body(FOUR_BIT_SHARDABLE, distributed=ds))


def test_ddp_takes_either_quantization() -> None:
    ddp = {"strategy": "ddp", "num_processes": 2}
    parse_job_spec(body({"load_in": "8bit"}, distributed=ddp))
    parse_job_spec(body({"load_in": "4bit"}, distributed=ddp))
