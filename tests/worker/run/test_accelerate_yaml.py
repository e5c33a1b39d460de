"""worker.run.accelerate_config's YAML per strategy and option: what it writes for each, and
the configurations it refuses because they cannot run."""

from __future__ import annotations

import pytest
import yaml

from core.spec import JobSpec, SpecError
from tests.utils.launch_configs import (
    DDP_MULTI_MACHINE,
    DS_MULTI_MACHINE,
    DS_Z2,
    DS_Z3_CPU,
    DS_Z3_NVME,
    FSDP1,
    FSDP1_HYBRID_MULTI_MACHINE,
    FSDP1_NO_SHARD,
    FSDP2,
    FSDP2_SIZE,
    launcher_env_in_process,
    make_spec,
    plugin_env,
    write_yaml,
)
from worker.run.accelerate_config import (
    AccelerateConfigError,
    FsdpLayerClassError,
    accelerate_config,
    launch_env,
    render_yaml,
)


def test_none_on_cpu_is_one_cpu_process():
    cfg = accelerate_config(make_spec(), device="cpu")
    assert cfg == {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO",
        "mixed_precision": "no",
        "use_cpu": True,
        "debug": False,
        "num_processes": 1,
        "num_machines": 1,
        "gpu_ids": "all",
        "enable_cpu_affinity": False,
        "downcast_bf16": False,
        "dynamo_config": {"dynamo_backend": "NO"},
    }


def test_ddp_on_cpu_is_multi_gpu_with_use_cpu_and_a_free_port():
    cfg = accelerate_config(make_spec({"strategy": "ddp", "num_processes": 2}), device="cpu")
    assert cfg["distributed_type"] == "MULTI_GPU"  # MULTI_CPU would start one process
    assert (cfg["use_cpu"], cfg["num_processes"], cfg["machine_rank"]) == (True, 2, 0)
    assert cfg["main_process_port"] == 0
    assert "main_process_ip" not in cfg
    assert "fsdp_config" not in cfg and "deepspeed_config" not in cfg


def test_ddp_multi_machine_names_the_main_process():
    cfg = accelerate_config(make_spec(DDP_MULTI_MACHINE), device="cuda")
    assert (cfg["num_processes"], cfg["num_machines"], cfg["machine_rank"]) == (4, 2, 1)
    assert (cfg["main_process_ip"], cfg["main_process_port"]) == ("10.0.0.1", 29555)


def test_multi_machine_without_port_uses_one_fixed_port():
    spec = make_spec({**DDP_MULTI_MACHINE, "main_process_port": None})
    assert accelerate_config(spec, device="cuda")["main_process_port"] == 29500


def test_fsdp2_writes_reshard_after_forward_and_no_fsdp1_keys():
    cfg = accelerate_config(make_spec(FSDP2), device="cuda", layer_cls=["LlamaDecoderLayer"])
    assert cfg["distributed_type"] == "FSDP"
    assert cfg["fsdp_config"] == {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": True,
        "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
        "fsdp_activation_checkpointing_offload": False,
    }


def test_fsdp2_shard_grad_op_keeps_parameters_after_forward():
    cfg = accelerate_config(make_spec(FSDP2_SIZE), device="cuda")
    fsdp = cfg["fsdp_config"]
    assert fsdp["fsdp_reshard_after_forward"] is False
    assert fsdp["fsdp_min_num_params"] == 1000
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp


def test_fsdp1_writes_sharding_strategy_and_fsdp1_options():
    cfg = accelerate_config(make_spec(FSDP1), device="cuda", layer_cls=["Ignored"])
    fsdp = cfg["fsdp_config"]
    assert "fsdp_reshard_after_forward" not in fsdp
    assert fsdp["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    assert fsdp["fsdp_backward_prefetch"] == "BACKWARD_POST"
    assert (fsdp["fsdp_forward_prefetch"], fsdp["fsdp_use_orig_params"]) == (True, True)
    assert fsdp["fsdp_sync_module_states"] is True
    # The spec's own classes win over the caller's default.
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer,LlamaRMSNorm"


def test_fsdp_no_wrap_writes_neither_classes_nor_min_params():
    fsdp = accelerate_config(make_spec(FSDP1_NO_SHARD), device="cuda")["fsdp_config"]
    assert fsdp["fsdp_auto_wrap_policy"] == "NO_WRAP"
    assert not {"fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params"} & set(fsdp)


def test_fsdp_transformer_wrap_without_classes_is_refused():
    with pytest.raises(FsdpLayerClassError, match="needs layer classes"):
        accelerate_config(make_spec(FSDP2), device="cuda")


def test_deepspeed_zero3_takes_clipping_and_accumulation_from_training():
    spec = make_spec(DS_Z3_CPU, gradient_accumulation_steps=4, max_grad_norm=0.5)
    cfg = accelerate_config(spec, device="cuda")
    assert cfg["distributed_type"] == "DEEPSPEED"
    assert cfg["deepspeed_config"] == {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
        "zero3_init_flag": True,
        "zero3_save_16bit_model": True,
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,
    }


def test_deepspeed_below_zero3_writes_zero3_flags_false():
    ds = accelerate_config(make_spec(DS_Z2), device="cuda")["deepspeed_config"]
    assert (ds["zero_stage"], ds["offload_optimizer_device"], ds["offload_param_device"]) == (
        2,
        "cpu",
        "none",
    )
    assert (ds["zero3_init_flag"], ds["zero3_save_16bit_model"]) == (False, False)


def test_deepspeed_nvme_offload_writes_both_paths():
    ds = accelerate_config(make_spec(DS_Z3_NVME), device="cuda")["deepspeed_config"]
    assert ds["offload_optimizer_nvme_path"] == ds["offload_param_nvme_path"] == "/local_nvme"


def test_deepspeed_multi_machine_uses_the_standard_launcher():
    cfg = accelerate_config(make_spec(DS_MULTI_MACHINE), device="cuda")
    assert cfg["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert (cfg["main_process_ip"], cfg["main_process_port"]) == ("10.0.0.1", 29500)


def test_deepspeed_on_a_cpu_worker_never_sets_use_cpu():
    spec = make_spec(DS_Z3_CPU)
    assert accelerate_config(spec, device="cpu")["use_cpu"] is False
    assert "ACCELERATE_USE_CPU" not in launch_env(spec, device="cpu")


def test_deepspeed_on_a_cpu_worker_names_deepspeeds_cpu_accelerator():
    spec = make_spec(DS_Z3_CPU)
    assert launch_env(spec, device="cpu") == {"DS_ACCELERATOR": "cpu"}
    assert launch_env(spec, device="cuda") == {}


def test_fsdp2_activation_checkpointing_offload_is_written():
    fsdp = accelerate_config(make_spec(FSDP2_SIZE), device="cuda")["fsdp_config"]
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert fsdp["fsdp_activation_checkpointing_offload"] is True


def test_fsdp1_hybrid_shard_zero2_across_machines(tmp_path, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import ShardingStrategy

    spec = make_spec(FSDP1_HYBRID_MULTI_MACHINE)
    cfg = accelerate_config(spec, device="cuda", layer_cls=["LlamaDecoderLayer"])
    assert cfg["fsdp_config"]["fsdp_sharding_strategy"] == "HYBRID_SHARD_ZERO2"
    seen = launcher_env_in_process(write_yaml(cfg, tmp_path / "a.yaml"), monkeypatch)
    env = seen["env"]
    assert seen["launcher"] == "multi_gpu"
    assert (seen["args"].nnodes, seen["args"].node_rank) == ("2", 1)
    assert env["FSDP_SHARDING_STRATEGY"] == "HYBRID_SHARD_ZERO2"
    plugin_env(env, monkeypatch)
    monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "false")  # its device lookup needs a GPU
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.sharding_strategy == ShardingStrategy._HYBRID_SHARD_ZERO2


def test_gpu_ids_are_a_comma_list():
    spec = make_spec({"strategy": "ddp", "num_processes": 2})
    assert accelerate_config(spec, device="cuda", gpu_ids=[2, 3])["gpu_ids"] == "2,3"


def test_mixed_precision_is_written():
    spec = make_spec({"strategy": "ddp", "num_processes": 2}, mixed_precision="bf16")
    assert accelerate_config(spec, device="cuda")["mixed_precision"] == "bf16"


@pytest.mark.parametrize(
    ("distributed", "training", "device", "gpu_ids", "param"),
    [
        (FSDP2, {}, "cpu", None, "distributed.strategy"),
        ({}, {"mixed_precision": "bf16"}, "cpu", None, "training.mixed_precision"),
        ({"strategy": "ddp", "num_processes": 2}, {}, "cpu", [0, 1], "gpu_ids"),
        ({"strategy": "ddp", "num_processes": 2}, {}, "cuda", [0], "gpu_ids"),
        ({"strategy": "ddp", "num_processes": 2}, {}, "cuda", [1, 1], "gpu_ids"),
        ({}, {}, "tpu", None, "device"),
    ],
    ids=[
        "fsdp-cpu",
        "bf16-cpu",
        "gpus-on-cpu",
        "too-few-gpus",
        "duplicate-gpus",
        "device",
    ],
)
def test_configs_that_cannot_run_are_refused(distributed, training, device, gpu_ids, param):
    with pytest.raises(AccelerateConfigError) as e:
        accelerate_config(make_spec(distributed, **training), device=device, gpu_ids=gpu_ids)
    assert e.value.param == param


def test_an_unvalidated_spec_is_refused():
    spec = JobSpec.model_validate(
        {
            "model": {"name_or_path": "tiny"},
            "dataset": {"path": "/data/train.jsonl"},
            "distributed": {
                "strategy": "fsdp",
                "num_processes": 2,
                "fsdp": {"forward_prefetch": True},
            },
        }
    )
    with pytest.raises(SpecError, match="forward_prefetch"):
        accelerate_config(spec, device="cuda", layer_cls=["X"])


def test_render_yaml_is_sorted_stable_and_round_trips():
    cfg = accelerate_config(make_spec(FSDP2), device="cuda", layer_cls=["LlamaDecoderLayer"])
    text = render_yaml(cfg)
    assert text == render_yaml(dict(reversed(list(cfg.items()))))
    assert yaml.safe_load(text) == cfg  # 'no' / 'NO' stay strings
    top = [line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")]
    assert top == sorted(top)
