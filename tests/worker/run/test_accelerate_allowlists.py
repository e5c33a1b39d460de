"""worker.run.accelerate_config's allowlists checked against accelerate's own source: every
key the generator may write is one accelerate's launcher reads and uses as written (unknown or
misspelled keys are ignored silently, /work/shared/FACTS.md), for every scenario of
tests/utils/launch_configs.py."""

from __future__ import annotations

import inspect

import pytest

from tests.utils.launch_configs import (
    FSDP1,
    SCENARIO_IDS,
    SCENARIOS,
    args_read_by,
    launch_parser_dests,
    launcher_args,
    launcher_env_in_process,
    scenario_config,
    write_yaml,
)
from worker.run.accelerate_config import (
    DEEPSPEED_KEYS,
    DEEPSPEED_KEYS_NOT_EXPORTED,
    DYNAMO_KEYS,
    FSDP_KEYS,
    NVME_PATH_ENV,
    TOP_LEVEL_KEYS,
)


def test_top_level_keys_are_accelerate_cluster_config_fields():
    from accelerate.commands.config.config_args import ClusterConfig

    fields = set(ClusterConfig.__dataclass_fields__)
    assert TOP_LEVEL_KEYS <= fields, TOP_LEVEL_KEYS - fields
    assert not {k for k in TOP_LEVEL_KEYS if k.startswith("tpu") or "megatron" in k}


def test_fsdp_keys_are_launch_args_exported_by_prepare_multi_gpu_env():
    from accelerate.utils.launch import prepare_multi_gpu_env

    read = args_read_by(prepare_multi_gpu_env)
    assert FSDP_KEYS <= launch_parser_dests()
    assert FSDP_KEYS <= read, FSDP_KEYS - read
    assert "fsdp_backward_prefetch_policy" not in read | launch_parser_dests()


def test_deepspeed_keys_are_launch_args_read_by_the_deepspeed_launcher():
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    read = args_read_by(prepare_deepspeed_cmd_env)
    exported = DEEPSPEED_KEYS - DEEPSPEED_KEYS_NOT_EXPORTED
    assert DEEPSPEED_KEYS <= launch_parser_dests()
    assert exported <= read, exported - read


def test_accelerate_still_drops_nvme_paths_so_launch_env_must_carry_them():
    # When this fails, accelerate exports the NVMe paths itself: drop them from launch_env.
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    assert not DEEPSPEED_KEYS_NOT_EXPORTED & args_read_by(prepare_deepspeed_cmd_env)
    plugin_source = inspect.getsource(DeepSpeedPlugin.__post_init__)
    assert set(NVME_PATH_ENV) == DEEPSPEED_KEYS_NOT_EXPORTED
    assert all(f'"{name}"' in plugin_source for name in NVME_PATH_ENV.values())


def test_dynamo_keys_are_launch_args():
    assert DYNAMO_KEYS <= launch_parser_dests()


@pytest.mark.parametrize(("name", "distributed", "training", "device"), SCENARIOS, ids=SCENARIO_IDS)
def test_every_emitted_key_is_allowlisted(name, distributed, training, device):
    _, cfg = scenario_config(distributed, training, device)
    assert set(cfg) <= TOP_LEVEL_KEYS
    assert set(cfg.get("fsdp_config", {})) <= FSDP_KEYS
    assert set(cfg.get("deepspeed_config", {})) <= DEEPSPEED_KEYS
    assert set(cfg["dynamo_config"]) <= DYNAMO_KEYS


@pytest.mark.parametrize(("name", "distributed", "training", "device"), SCENARIOS, ids=SCENARIO_IDS)
def test_accelerate_uses_every_emitted_value_as_written(
    name, distributed, training, device, tmp_path
):
    """After accelerate's own parsing, each launch arg equals what the YAML says: no key is
    ignored or overridden by a launcher default."""
    _, cfg = scenario_config(distributed, training, device)
    args = launcher_args(write_yaml(cfg, tmp_path / "a.yaml"))
    strategy = distributed.get("strategy", "none")
    assert args.use_fsdp == (strategy == "fsdp")
    assert args.use_deepspeed == (strategy == "deepspeed")
    assert args.multi_gpu == (strategy == "ddp")
    for key, value in cfg.items():
        if key in ("compute_environment", "distributed_type"):
            continue
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for arg, v in items:
            assert getattr(args, arg) == v, (arg, getattr(args, arg), v)


def test_launcher_ignores_yaml_values_of_flags_with_argparse_defaults(tmp_path):
    # Why those keys are always written with accelerate's defaults: other values do nothing.
    _, cfg = scenario_config({"strategy": "ddp", "num_processes": 2}, {}, "cuda")
    cfg.update(same_network=True, rdzv_backend="c10d", enable_cpu_affinity=True, downcast_bf16=True)
    args = launcher_args(write_yaml(cfg, tmp_path / "a.yaml"))
    assert (args.same_network, args.rdzv_backend) == (False, "static")
    assert (args.enable_cpu_affinity, args.downcast_bf16) == (False, False)


def test_accelerate_silently_ignores_a_misspelled_fsdp_key(tmp_path, monkeypatch):
    _, cfg = scenario_config(FSDP1, {}, "cuda")
    del cfg["fsdp_config"]["fsdp_backward_prefetch"]
    cfg["fsdp_config"]["fsdp_backward_prefetch_policy"] = "BACKWARD_POST"  # the docs' spelling
    env = launcher_env_in_process(write_yaml(cfg, tmp_path / "a.yaml"), monkeypatch)["env"]
    assert "FSDP_BACKWARD_PREFETCH" not in env


@pytest.mark.parametrize(("name", "distributed", "training", "device"), SCENARIOS, ids=SCENARIO_IDS)
def test_yaml_loads_with_accelerates_own_config_loader(
    name, distributed, training, device, tmp_path
):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    _, cfg = scenario_config(distributed, training, device)
    loaded = load_config_from_file(str(write_yaml(cfg, tmp_path / "a.yaml")))
    assert isinstance(loaded, ClusterConfig)
    assert loaded.distributed_type.value == cfg["distributed_type"]
