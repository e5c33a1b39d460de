"""What `accelerate launch` of worker.run.accelerate_config's YAML and argv really hands each
rank: real launches with tests/worker/dump_env.py in core.train's place (one record per rank:
the launcher's environment and, with ``state``, what accelerate's PartialState makes of it)."""

from __future__ import annotations

import pytest

from tests.utils.jobdirs import HAS_DEEPSPEED
from tests.utils.launch_configs import (
    DS_Z3_CPU,
    DS_Z3_NVME,
    FSDP1,
    FSDP1_NO_SHARD,
    FSDP2,
    FSDP2_SIZE,
    launch_dump_env,
    make_spec,
    plugin_env,
)
from worker.run.accelerate_config import (
    accelerate_config,
    launch_env,
)


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="accelerate refuses to launch DeepSpeed without it")
def test_launch_deepspeed_zero3_cpu_offload(tmp_path):
    spec = make_spec(DS_Z3_CPU, gradient_accumulation_steps=2)
    ranks = launch_dump_env(tmp_path, accelerate_config(spec, device="cuda"))
    assert [r["env"]["WORLD_SIZE"] for r in ranks] == ["2", "2"]
    env = ranks[1]["env"]
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert env["ACCELERATE_GRADIENT_CLIPPING"] == "1.0"


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="accelerate refuses to launch DeepSpeed without it")
def test_launch_deepspeed_nvme_paths_reach_the_ranks_through_launch_env(tmp_path):
    spec = make_spec(DS_Z3_NVME)
    cfg = accelerate_config(spec, device="cuda")
    ranks = launch_dump_env(tmp_path, cfg, extra_env=launch_env(spec, device="cuda"))
    env = ranks[0]["env"]
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "nvme"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"] == "/local_nvme"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"] == "/local_nvme"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "false"


@pytest.mark.e2e
@pytest.mark.slow  # the first DeepSpeed process group on a machine builds an op (~100 s)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="accelerate refuses to launch DeepSpeed without it")
def test_launch_deepspeed_on_a_cpu_worker_is_two_deepspeed_ranks_with_gloo(tmp_path):
    # No use_cpu (it turns DeepSpeed off); the trainer passes ddp_backend="gloo", without
    # which accelerate reports every CPU rank as process 0 of 1.
    spec = make_spec(DS_Z3_CPU)
    cfg = accelerate_config(spec, device="cpu")
    ranks = launch_dump_env(tmp_path, cfg, extra_env=launch_env(spec, device="cpu"), state="gloo")
    assert [r["distributed_type"] for r in ranks] == ["DEEPSPEED", "DEEPSPEED"]
    assert [(r["num_processes"], r["process_index"]) for r in ranks] == [(2, 0), (2, 1)]


@pytest.mark.e2e
def test_launch_none_on_cpu_runs_one_cpu_process(tmp_path):
    spec = make_spec()
    ranks = launch_dump_env(
        tmp_path,
        accelerate_config(spec, device="cpu"),
        extra_env=launch_env(spec, device="cpu"),
        state=True,
    )
    assert len(ranks) == 1
    (rank,) = ranks
    assert rank["distributed_type"] == "NO" and rank["num_processes"] == 1
    assert rank["env"]["ACCELERATE_USE_CPU"] == "True"
    assert rank["env"]["ACCELERATE_MIXED_PRECISION"] == "no"
    assert "WORLD_SIZE" not in rank["env"]


@pytest.mark.e2e
def test_launch_ddp_on_cpu_is_real_two_process_gloo(tmp_path):
    spec = make_spec({"strategy": "ddp", "num_processes": 2})
    ranks = launch_dump_env(
        tmp_path,
        accelerate_config(spec, device="cpu"),
        extra_env=launch_env(spec, device="cpu"),
        state=True,
    )
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"]
    assert all(r["env"]["WORLD_SIZE"] == "2" for r in ranks)
    assert all(r["distributed_type"] == "MULTI_CPU" and r["backend"] == "gloo" for r in ranks)
    assert [r["process_index"] for r in ranks] == [0, 1]
    assert int(ranks[0]["env"]["MASTER_PORT"]) > 0  # 0 in the YAML: accelerate picked a free port
    assert len({r["pid"] for r in ranks}) == 2


@pytest.mark.e2e
def test_launch_ddp_on_cpu_without_launch_env_runs_ranks_alone(tmp_path):
    # Why launch_env exists: torchrun starts 2 ranks, but the YAML's use_cpu never reaches
    # them and accelerate then treats each CPU rank as a lone process.
    spec = make_spec({"strategy": "ddp", "num_processes": 2})
    ranks = launch_dump_env(tmp_path, accelerate_config(spec, device="cpu"), state=True)
    assert [r["env"]["WORLD_SIZE"] for r in ranks] == ["2", "2"]
    assert [r["distributed_type"] for r in ranks] == ["NO", "NO"]


@pytest.mark.e2e
def test_launch_ddp_gpu_ids_precision_and_cli_port(tmp_path):
    spec = make_spec({"strategy": "ddp", "num_processes": 2}, mixed_precision="fp16")
    cfg = accelerate_config(spec, device="cuda", gpu_ids=[0, 1])
    ranks = launch_dump_env(tmp_path, cfg, main_process_port=29611)
    for r in ranks:
        assert r["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert r["env"]["ACCELERATE_MIXED_PRECISION"] == "fp16"
        assert r["env"]["MASTER_PORT"] == "29611"  # the CLI port wins over the YAML's 0
        assert "ACCELERATE_USE_FSDP" not in r["env"]


@pytest.mark.e2e
def test_launch_fsdp2_full_shard_offload(tmp_path, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    spec = make_spec(
        {**FSDP2, "fsdp": {"offload_params": True, "activation_checkpointing": True}},
        mixed_precision="bf16",
    )
    cfg = accelerate_config(spec, device="cuda", layer_cls=["LlamaDecoderLayer"])
    ranks = launch_dump_env(tmp_path, cfg)
    assert [r["env"]["WORLD_SIZE"] for r in ranks] == ["2", "2"]
    env = ranks[0]["env"]
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    assert env["FSDP_OFFLOAD_PARAMS"] == "true"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == "true"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"

    plugin_env(env, monkeypatch)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # FSDP2: parameters on CPU
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]


@pytest.mark.e2e
def test_launch_fsdp2_shard_grad_op_size_wrap(tmp_path, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    ranks = launch_dump_env(tmp_path, accelerate_config(make_spec(FSDP2_SIZE), device="cuda"))
    env = ranks[0]["env"]
    assert env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "SIZE_BASED_WRAP"
    assert env["FSDP_MIN_NUM_PARAMS"] == "1000"
    assert "FSDP_TRANSFORMER_CLS_TO_WRAP" not in env
    assert env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    assert env["FSDP_OFFLOAD_PARAMS"] == "true"
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == "true"
    assert env["FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"] == "true"

    plugin_env(env, monkeypatch)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.reshard_after_forward is False and plugin.min_num_params == 1000
    assert plugin.activation_checkpointing and plugin.activation_checkpointing_offload


@pytest.mark.e2e
def test_launch_fsdp1_shard_grad_op_with_fsdp1_options(tmp_path):
    ranks = launch_dump_env(tmp_path, accelerate_config(make_spec(FSDP1), device="cuda"))
    env = ranks[1]["env"]
    assert env["FSDP_VERSION"] == "1"
    assert env["FSDP_SHARDING_STRATEGY"] == "SHARD_GRAD_OP"
    assert env["FSDP_BACKWARD_PREFETCH"] == "BACKWARD_POST"
    assert env["FSDP_FORWARD_PREFETCH"] == "true"
    assert env["FSDP_USE_ORIG_PARAMS"] == "true"
    assert env["FSDP_SYNC_MODULE_STATES"] == "true"
    assert env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer,LlamaRMSNorm"
    assert env["FSDP_OFFLOAD_PARAMS"] == "false"


@pytest.mark.e2e
def test_launch_fsdp1_no_shard_no_prefetch_local_state_dict(tmp_path, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    spec = make_spec(FSDP1_NO_SHARD, mixed_precision="fp16")
    ranks = launch_dump_env(tmp_path, accelerate_config(spec, device="cuda"))
    env = ranks[0]["env"]
    assert env["FSDP_SHARDING_STRATEGY"] == "NO_SHARD"
    assert env["FSDP_BACKWARD_PREFETCH"] == "NO_PREFETCH"
    assert env["FSDP_STATE_DICT_TYPE"] == "LOCAL_STATE_DICT"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "NO_WRAP"
    assert env["FSDP_SYNC_MODULE_STATES"] == "false"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp16"

    plugin_env(env, monkeypatch)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.sharding_strategy == ShardingStrategy.NO_SHARD
    assert plugin.backward_prefetch is None
    assert plugin.state_dict_type == StateDictType.LOCAL_STATE_DICT
    assert plugin.auto_wrap_policy is None
