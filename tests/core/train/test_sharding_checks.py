"""core.train.sharding without launching anything: the device arguments per strategy and the
"settings in effect vs spec" check, fed with stand-ins for what accelerate builds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from core.infra.errors import ErrorCode, TrainFailure
from core.train.sharding import base_partitioned, check_sharding, device_arguments
from tests.utils.specs import parsed_spec


def spec(distributed: dict[str, Any]) -> Any:
    return parsed_spec(distributed=distributed)


Z3 = {
    "strategy": "deepspeed",
    "num_processes": 2,
    "deepspeed": {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
    },
}


def model(partitioned: bool) -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    if partitioned:
        for p in m[0].parameters():
            p.ds_id = 0  # what zero.Init leaves on every parameter it partitions
    return m


def ds_trainer(zero: dict[str, Any], partitioned: bool = True, init: bool = True) -> Any:
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": zero}, zero3_init_flag=init)
    state = SimpleNamespace(deepspeed_plugin=plugin)
    return SimpleNamespace(accelerator=SimpleNamespace(state=state), model=model(partitioned))


ZERO3_CONFIG = {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "nvme_path": None},
    "offload_param": {"device": "cpu", "nvme_path": None},
}


def test_deepspeed_never_gets_use_cpu_and_takes_gloo_on_cpu() -> None:
    assert device_arguments("deepspeed", "cpu") == {"use_cpu": False, "ddp_backend": "gloo"}
    assert device_arguments("deepspeed", "cuda") == {"use_cpu": False, "ddp_backend": None}
    assert device_arguments("ddp", "cpu") == {"use_cpu": True}
    assert device_arguments("fsdp", "cuda") == {"use_cpu": False}


def test_zero3_as_asked_is_reported_for_the_started_event() -> None:
    got = check_sharding(ds_trainer(ZERO3_CONFIG), spec(Z3))
    assert got["zero_stage"] == 3
    assert got["offload_optimizer_device"] == got["offload_param_device"] == "cpu"
    assert got["params_partitioned_at_load"] is True and got["zero3_init"] is True


def test_a_zero_stage_other_than_the_spec_fails_the_run() -> None:
    zero = {**ZERO3_CONFIG, "stage": 2, "offload_param": {"device": "none"}}
    with pytest.raises(TrainFailure) as e:
        check_sharding(ds_trainer(zero, partitioned=False), spec(Z3))
    assert e.value.code == ErrorCode.strategy_mismatch
    assert "zero_stage 3 asked, 2 in effect" in e.value.message
    assert "offload_param_device 'cpu' asked, 'none' in effect" in e.value.message


def test_zero3_that_loaded_the_whole_model_on_every_rank_fails_the_run() -> None:
    with pytest.raises(TrainFailure, match="loaded whole on every rank"):
        check_sharding(ds_trainer(ZERO3_CONFIG, partitioned=False), spec(Z3))


def test_zero3_init_off_may_load_whole() -> None:
    z3_no_init = {**Z3, "deepspeed": {**Z3["deepspeed"], "zero3_init_flag": False}}
    got = check_sharding(ds_trainer(ZERO3_CONFIG, partitioned=False, init=False), spec(z3_no_init))
    assert got["params_partitioned_at_load"] is False


def test_fsdp_version_or_state_dict_type_other_than_the_spec_fails_the_run() -> None:
    from torch.distributed.fsdp import StateDictType

    fsdp = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2}}

    def trainer(version: int, sd: StateDictType) -> Any:
        plugin = SimpleNamespace(fsdp_version=version, state_dict_type=sd, cpu_offload=None)
        return SimpleNamespace(
            accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
        )

    got = check_sharding(trainer(2, StateDictType.SHARDED_STATE_DICT), spec(fsdp))
    assert got["fsdp_version"] == 2 and got["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    with pytest.raises(TrainFailure, match="version 2 / SHARDED_STATE_DICT asked, version 1"):
        check_sharding(trainer(1, StateDictType.FULL_STATE_DICT), spec(fsdp))


def test_other_strategies_add_nothing() -> None:
    assert check_sharding(SimpleNamespace(), spec({"strategy": "ddp", "num_processes": 2})) == {}


def test_partitioned_means_every_frozen_base_weight() -> None:
    assert base_partitioned(model(True)) and not base_partitioned(model(False))


def test_fsdp_that_did_not_shard_fails_the_run() -> None:
    """What an accelerate upgrade that silently stops sharding on CPU would leave: plain
    tensors. The trainer refuses to train such a run as if it were FSDP."""
    from core.train.sharding import fsdp_sharded

    with pytest.raises(TrainFailure, match="none of the 4 parameters is sharded") as e:
        fsdp_sharded(model(False), world_size=2)
    assert e.value.code == ErrorCode.strategy_mismatch
    with pytest.raises(TrainFailure, match="no FullyShardedDataParallel unit") as e:
        fsdp_sharded(model(False), world_size=2, version=1)
    assert e.value.code == ErrorCode.strategy_mismatch
