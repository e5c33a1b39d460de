"""core.hardware: what a CPU-only worker runs, and that the YAML generator and the launch
environment follow the same rule."""

from __future__ import annotations

from typing import Any

import pytest

from core.hardware import cpu_refusal
from core.spec import parse_job_spec
from worker.accelerate_config import AccelerateConfigError, accelerate_config, launch_env


def spec(distributed: dict[str, Any] | None = None, **training: Any) -> Any:
    return parse_job_spec(
        {
            "model": {"name_or_path": "org/m"},
            "dataset": {"path": "/d"},
            "distributed": distributed or {"strategy": "none"},
            "training": training,
        }
    )


FSDP2 = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2}}
FSDP1 = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 1}}


def test_fsdp_is_refused_on_cpu_unless_the_operator_allows_fsdp2() -> None:
    refusal = cpu_refusal(spec(FSDP2), cpu_fsdp2=False)
    assert refusal is not None and refusal.param == "distributed.strategy"
    assert "FTUNE_CPU_FSDP2" in refusal.message
    assert cpu_refusal(spec(FSDP2), cpu_fsdp2=True) is None


def test_fsdp1_is_refused_on_cpu_even_when_fsdp2_is_allowed() -> None:
    refusal = cpu_refusal(spec(FSDP1), cpu_fsdp2=True)
    assert refusal is not None and refusal.param == "distributed.fsdp.version"
    assert str(refusal).startswith("distributed.fsdp.version 1 needs a GPU worker")


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
