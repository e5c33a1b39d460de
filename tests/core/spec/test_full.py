"""peft method full: accepted with every strategy and with grpo, refused where it means
nothing (a quantized base, a merged export, a preference objective's disabled-adapter
reference), each with the field to change."""

from __future__ import annotations

from typing import Any

import pytest

from core.spec import FullSpec, SpecError, parse_job_spec, resolved_spec


def body(**over: Any) -> dict[str, Any]:
    return {"model": {"name_or_path": "org/tiny"}, "dataset": {"file_id": "file-1"},
            "peft": {"method": "full"}, **over}


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_job_spec(data)
    return {p.param: p.message for p in e.value.problems}


@pytest.mark.parametrize("distributed", [
    {"strategy": "none"},
    {"strategy": "ddp", "num_processes": 2},
    {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2, "offload_params": True}},
    {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 1}},
    {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 0}},
    {"strategy": "deepspeed", "num_processes": 2,
     "deepspeed": {"zero_stage": 2, "offload_optimizer_device": "cpu"}},
    {"strategy": "deepspeed", "num_processes": 2,
     "deepspeed": {"zero_stage": 3, "offload_optimizer_device": "nvme",
                   "offload_param_device": "nvme", "nvme_path": "/nvme"}},
])
def test_full_runs_under_every_strategy(distributed: dict[str, Any]) -> None:
    spec = parse_job_spec(body(distributed=distributed))
    assert isinstance(spec.peft, FullSpec)
    assert resolved_spec(spec)["peft"] == {"method": "full"}


def test_fsdp1_full_needs_the_original_parameters_and_nothing_else() -> None:
    # FSDP1's rule against mixed dtypes is about a float32 adapter inside a 16-bit frozen
    # layer: it does not apply. use_orig_params does: the model is written under the
    # original parameters' names (core/train/full_model.py).
    found = problems(body(model={"name_or_path": "org/tiny", "dtype": "bfloat16"},
                          distributed={"strategy": "fsdp", "num_processes": 2,
                                       "fsdp": {"version": 1, "use_orig_params": False}}))
    assert list(found) == ["distributed.fsdp.use_orig_params"]
    assert "full fine-tuning" in found["distributed.fsdp.use_orig_params"]


def test_full_on_a_quantized_base_is_refused_naming_the_method() -> None:
    found = problems(body(model={"name_or_path": "org/tiny", "quantization": {"load_in": "4bit"}}))
    assert "quantized (4-bit/8-bit) weights cannot be trained" in found["peft.method"]


def test_nothing_to_merge_and_no_adapter_to_disable() -> None:
    found = problems(body(training={"export_merged": True}))
    assert found == {"training.export_merged": "nothing to merge: peft method full saves the "
                     "whole trained model"}
    dpo = problems(body(dataset={"file_id": "f", "format": "preference"},
                        training={"objective": "dpo"}))
    assert dpo["peft.method"] == "objective dpo needs lora or ia3, not full"


def test_grpo_trains_in_full() -> None:
    # Its reference (beta > 0) is a frozen copy of the base, not a disabled adapter.
    grader = {"type": "string_check", "name": "c", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "eq"}
    spec = parse_job_spec(body(
        dataset={"file_id": "f", "format": "chat"},
        training={"objective": "grpo", "per_device_train_batch_size": 4,
                  "grpo": {"grader": grader, "num_generations": 4, "beta": 0.04}}))
    assert isinstance(spec.peft, FullSpec) and spec.training.objective == "grpo"


def test_a_misspelled_method_lists_full() -> None:
    assert "full" in problems(body(peft={"method": "ful"}))["peft"]
