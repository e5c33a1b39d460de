"""core.policy.hardware: what a CPU-only worker runs, what a worker with N GPUs runs, what
the trainer's machine runs, and that the YAML generator and the launch environment follow
the same rule (the generator calls it; there is no second copy to keep in agreement)."""

from __future__ import annotations

from typing import Any

import pytest

from core.policy import cpu_refusal, device_refusal, worker_refusal
from core.spec import parse_job_spec
from tests.utils.specs import parsed_spec
from worker.run.accelerate_config import AccelerateConfigError, accelerate_config, launch_env


def spec(distributed: dict[str, Any] | None = None, **training: Any) -> Any:
    return parsed_spec(distributed=distributed or {"strategy": "none"}, training=training)


FSDP2 = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2}}
FSDP1 = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 1}}
FSDP1_CPU = {"strategy": "fsdp", "num_processes": 2,
             "fsdp": {"version": 1, "sync_module_states": False,
                      "cpu_ram_efficient_loading": False}}


def test_fsdp_is_refused_on_cpu_unless_the_operator_allows_fsdp2() -> None:
    refusal = cpu_refusal(spec(FSDP2), cpu_fsdp2=False)
    assert refusal is not None and refusal.param == "distributed.strategy"
    assert "FTUNE_CPU_FSDP2" in refusal.message
    assert cpu_refusal(spec(FSDP2), cpu_fsdp2=True) is None


def test_fsdp1_on_cpu_needs_sync_module_states_false() -> None:
    # torch's FSDP1 broadcasts rank 0's weights between GPU tensors only.
    refusal = cpu_refusal(spec(FSDP1), cpu_fsdp2=True)
    assert refusal is not None and refusal.param == "distributed.fsdp.sync_module_states"
    assert str(refusal).startswith("distributed.fsdp.sync_module_states true needs a GPU worker")
    assert cpu_refusal(spec(FSDP1_CPU), cpu_fsdp2=True) is None
    assert cpu_refusal(spec(FSDP1_CPU), cpu_fsdp2=False) is not None  # the operator's opt-in


def test_cpu_fsdp1_runs_on_the_cpu_device() -> None:
    # Without ACCELERATE_TORCH_DEVICE, FSDP1 moves each unit to an accelerator that is not there.
    assert launch_env(spec(FSDP1_CPU), device="cpu") == {
        "ACCELERATE_USE_CPU": "true", "ACCELERATE_TORCH_DEVICE": "cpu"}
    assert launch_env(spec(FSDP2), device="cpu") == {"ACCELERATE_USE_CPU": "true"}
    assert launch_env(spec(FSDP1_CPU), device="cuda") == {}


@pytest.mark.parametrize("mp", ["fp16", "bf16"])
def test_mixed_precision_is_refused_on_cpu(mp: str) -> None:
    refusal = cpu_refusal(spec(mixed_precision=mp), cpu_fsdp2=True)
    assert refusal is not None and str(refusal).startswith(f"training.mixed_precision {mp} ")


def test_the_generator_refuses_what_the_rule_refuses() -> None:
    with pytest.raises(AccelerateConfigError) as e:
        accelerate_config(spec(FSDP2), device="cpu", layer_cls=["LlamaDecoderLayer"])
    assert e.value.param == "distributed.strategy"


def test_cpu_fsdp2_gets_the_fsdp_yaml_and_a_cpu_process_group() -> None:
    s = spec(FSDP2)
    cfg = accelerate_config(s, device="cpu", layer_cls=["LlamaDecoderLayer"], cpu_fsdp2=True)
    assert cfg["distributed_type"] == "FSDP" and cfg["use_cpu"] is False
    assert cfg["fsdp_config"]["fsdp_version"] == 2
    # The ranks learn they are CPU processes (gloo) from the launcher's environment.
    assert launch_env(s, device="cpu")["ACCELERATE_USE_CPU"] == "true"


@pytest.mark.parametrize(
    "distributed",
    [
        {"strategy": "none"},
        {"strategy": "ddp", "num_processes": 2},
        {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 2}},
        {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 3}},
    ],
    ids=["none", "ddp", "zero2", "zero3"],
)
def test_a_cpu_worker_runs_one_process_ddp_and_deepspeed(distributed: dict[str, Any]) -> None:
    assert worker_refusal(spec(distributed), gpus=0, cpu_fsdp2=False) is None


def test_a_cpu_worker_applies_the_cpu_rule() -> None:
    refusal = worker_refusal(spec(FSDP2), gpus=0, cpu_fsdp2=False)
    assert refusal == cpu_refusal(spec(FSDP2), cpu_fsdp2=False)
    assert worker_refusal(spec(FSDP2), gpus=0, cpu_fsdp2=True) is None


def test_a_worker_runs_single_machine_jobs_only() -> None:
    two = {"strategy": "ddp", "num_processes": 2, "num_machines": 2, "main_process_ip": "10.0.0.1"}
    refusal = worker_refusal(spec(two), gpus=8, cpu_fsdp2=False)
    assert refusal is not None and refusal.code == "unsupported_hardware"
    assert str(refusal) == (
        "distributed.num_machines=2: this worker runs single-machine jobs only"
    )


def test_a_gpu_worker_refuses_more_processes_than_gpus() -> None:
    refusal = worker_refusal(spec({"strategy": "ddp", "num_processes": 4}), gpus=2, cpu_fsdp2=False)
    assert refusal is not None and refusal.param == "distributed.num_processes"
    assert str(refusal) == "distributed.num_processes=4 but this worker has 2 GPU(s)"
    assert worker_refusal(spec({"strategy": "ddp", "num_processes": 2}), gpus=2,
                          cpu_fsdp2=False) is None


def test_a_gpu_worker_runs_fsdp_and_mixed_precision() -> None:
    assert worker_refusal(spec(FSDP1, mixed_precision="bf16"), gpus=2, cpu_fsdp2=False) is None


def test_the_trainer_refuses_bf16_on_a_gpu_older_than_ampere() -> None:
    refusal = device_refusal(spec(mixed_precision="bf16"), "cuda", cuda_available=True,
                             bf16_ok=False, cpu_fsdp2=False)
    assert str(refusal) == "training.mixed_precision bf16 needs an Ampere or newer GPU"
    assert device_refusal(spec(mixed_precision="bf16"), "cuda", cuda_available=True,
                          bf16_ok=True, cpu_fsdp2=False) is None


def test_the_trainer_refuses_a_cuda_run_without_cuda() -> None:
    refusal = device_refusal(spec(), "cuda", cuda_available=False, bf16_ok=False, cpu_fsdp2=False)
    assert str(refusal) == "runtime.device is cuda but no CUDA device is visible"


def test_the_trainer_applies_the_cpu_rule_on_cpu() -> None:
    refusal = device_refusal(spec(FSDP2), "cpu", cuda_available=True, bf16_ok=True,
                             cpu_fsdp2=False)
    assert refusal == cpu_refusal(spec(FSDP2), cpu_fsdp2=False)


def test_quantization_needs_bitsandbytes_where_it_runs() -> None:
    from core.policy import bitsandbytes_installed, quantization_refusal

    quantized = parse_job_spec(
        {"model": {"name_or_path": "org/m", "quantization": {"load_in": "4bit"}},
         "dataset": {"path": "/d"}}
    )
    refusal = quantization_refusal(quantized, bitsandbytes_installed=False)
    assert refusal is not None and refusal.param == "model.quantization"
    assert refusal.code == "unsupported_hardware" and "bitsandbytes" in refusal.message
    assert quantization_refusal(quantized, bitsandbytes_installed=True) is None
    assert quantization_refusal(spec(), bitsandbytes_installed=False) is None
    assert bitsandbytes_installed()  # the test extra installs it


def test_cpu_workers_run_4bit_and_8bit() -> None:
    # bitsandbytes 0.50.2 trains LoRA on a 4-bit and an 8-bit base on CPU (seen here).
    for load_in in ("4bit", "8bit"):
        s = parse_job_spec(
            {"model": {"name_or_path": "org/m", "quantization": {"load_in": load_in}},
             "dataset": {"path": "/d"}}
        )
        assert worker_refusal(s, 0, cpu_fsdp2=False) is None


def test_the_worker_refuses_quantization_without_bitsandbytes() -> None:
    from core.infra.settings import Settings
    from core.policy import admission

    quantized = parse_job_spec(
        {"model": {"name_or_path": "org/m", "quantization": {"load_in": "8bit"}},
         "dataset": {"path": "/d"}}
    )
    without = admission.Installed(bitsandbytes=False, trl=True)
    (refusal,) = admission.claim(quantized, settings=Settings(), machine=admission.Machine(0),
                                 installed=without)
    assert refusal.param == "model.quantization"
    # Nothing quantized: nothing to refuse.
    assert admission.claim(spec(), settings=Settings(), machine=admission.Machine(0),
                           installed=without) == []


def test_preference_objectives_need_trl_where_they_run() -> None:
    from core.policy import preference_refusal, trl_installed

    dpo = parse_job_spec(
        {"model": {"name_or_path": "org/m"},
         "dataset": {"path": "/d", "format": "preference"},
         "training": {"objective": "dpo"}}
    )
    refusal = preference_refusal(dpo, trl_installed=False)
    assert refusal is not None and refusal.param == "training.objective"
    assert "trl" in refusal.message and "ftune[preference]" in refusal.message
    assert preference_refusal(dpo, trl_installed=True) is None
    assert preference_refusal(spec(), trl_installed=False) is None  # sft needs no trl
    assert trl_installed()  # the test extra installs it
