"""worker.run.accelerate_config: allowlists checked against accelerate's source, the YAML per
strategy, and what `accelerate launch` really hands each rank (tests/worker/dump_env.py).

accelerate's DeepSpeed launcher refuses to start without the deepspeed package (an optional
install), so DeepSpeed configs are also checked without it: accelerate's own
``launch_command`` runs in-process with only the final spawn replaced (routing, YAML parsing
and ``prepare_deepspeed_cmd_env`` are real), and the resulting env is fed to accelerate's
``DeepSpeedPlugin``. With deepspeed installed, real launches run too.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.spec import JobSpec, SpecError
from tests.utils.jobdirs import HAS_DEEPSPEED
from tests.utils.specs import parsed_spec
from worker.run.accelerate_config import (
    DEEPSPEED_KEYS,
    DEEPSPEED_KEYS_NOT_EXPORTED,
    DYNAMO_KEYS,
    FSDP_KEYS,
    NVME_PATH_ENV,
    TOP_LEVEL_KEYS,
    AccelerateConfigError,
    FsdpLayerClassError,
    accelerate_config,
    launch_argv,
    launch_env,
    render_yaml,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def make_spec(distributed: dict[str, Any] | None = None, **training: Any) -> JobSpec:
    return parsed_spec("tiny", dataset={"path": "/data/train.jsonl"},
                       distributed=distributed or {}, **({"training": training} if training else {}))


FSDP2 = {"strategy": "fsdp", "num_processes": 2}
FSDP2_SIZE = {
    "strategy": "fsdp",
    "num_processes": 2,
    "fsdp": {
        "sharding_strategy": "SHARD_GRAD_OP",
        "auto_wrap_policy": "SIZE_BASED_WRAP",
        "min_num_params": 1000,
        "state_dict_type": "FULL_STATE_DICT",
        "offload_params": True,
        "cpu_ram_efficient_loading": False,
        "activation_checkpointing": True,
        "activation_checkpointing_offload": True,
    },
}
FSDP1 = {
    "strategy": "fsdp",
    "num_processes": 2,
    "fsdp": {
        "version": 1,
        "sharding_strategy": "SHARD_GRAD_OP",
        "backward_prefetch": "BACKWARD_POST",
        "forward_prefetch": True,
        "state_dict_type": "FULL_STATE_DICT",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "LlamaRMSNorm"],
    },
}
# Hybrid sharding: shard within each machine, replicate across machines (FSDP1 only).
FSDP1_HYBRID_MULTI_MACHINE = {
    "strategy": "fsdp",
    "num_processes": 4,
    "num_machines": 2,
    "machine_rank": 1,
    "main_process_ip": "10.0.0.1",
    "fsdp": {"version": 1, "sharding_strategy": "HYBRID_SHARD_ZERO2"},
}
FSDP1_NO_SHARD = {
    "strategy": "fsdp",
    "num_processes": 2,
    "fsdp": {
        "version": 1,
        "sharding_strategy": "NO_SHARD",
        "backward_prefetch": "NO_PREFETCH",
        "state_dict_type": "LOCAL_STATE_DICT",
        "auto_wrap_policy": "NO_WRAP",
        "cpu_ram_efficient_loading": False,
        "sync_module_states": False,
    },
}
DS_Z3_CPU = {
    "strategy": "deepspeed",
    "num_processes": 2,
    "deepspeed": {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
    },
}
DS_Z3_NVME = {
    "strategy": "deepspeed",
    "num_processes": 2,
    "deepspeed": {
        "offload_optimizer_device": "nvme",
        "offload_param_device": "nvme",
        "nvme_path": "/local_nvme",
        "zero3_init_flag": False,
    },
}
DS_Z2 = {
    "strategy": "deepspeed",
    "num_processes": 2,
    "deepspeed": {"zero_stage": 2, "offload_optimizer_device": "cpu"},
}
DS_Z1_ONE_PROCESS = {"strategy": "deepspeed", "num_processes": 1, "deepspeed": {"zero_stage": 1}}
DS_MULTI_MACHINE = {
    "strategy": "deepspeed",
    "num_processes": 4,
    "num_machines": 2,
    "machine_rank": 1,
    "main_process_ip": "10.0.0.1",
}
DDP_MULTI_MACHINE = {
    "strategy": "ddp",
    "num_processes": 4,
    "num_machines": 2,
    "machine_rank": 1,
    "main_process_ip": "10.0.0.1",
    "main_process_port": 29555,
}

# (name, distributed, training, device): every strategy and every option at least once.
SCENARIOS = [
    ("none-cpu", {}, {}, "cpu"),
    ("none-cuda-bf16", {}, {"mixed_precision": "bf16"}, "cuda"),
    ("ddp-cpu", {"strategy": "ddp", "num_processes": 2}, {}, "cpu"),
    ("ddp-cuda-fp16", {"strategy": "ddp", "num_processes": 2}, {"mixed_precision": "fp16"}, "cuda"),
    ("ddp-multi-machine", DDP_MULTI_MACHINE, {}, "cuda"),
    ("fsdp2", FSDP2, {"mixed_precision": "bf16"}, "cuda"),
    ("fsdp2-size-wrap", FSDP2_SIZE, {}, "cuda"),
    ("fsdp1", FSDP1, {}, "cuda"),
    ("fsdp1-no-shard", FSDP1_NO_SHARD, {"mixed_precision": "fp16"}, "cuda"),
    ("fsdp1-hybrid-multi-machine", FSDP1_HYBRID_MULTI_MACHINE, {}, "cuda"),
    ("ds-z3-cpu-offload", DS_Z3_CPU, {"gradient_accumulation_steps": 4}, "cuda"),
    ("ds-z3-on-cpu-worker", DS_Z3_CPU, {}, "cpu"),
    ("ds-z3-nvme", DS_Z3_NVME, {"max_grad_norm": 0.5}, "cuda"),
    ("ds-z2", DS_Z2, {"mixed_precision": "bf16"}, "cuda"),
    ("ds-z1-one-process", DS_Z1_ONE_PROCESS, {}, "cuda"),
    ("ds-multi-machine", DS_MULTI_MACHINE, {}, "cuda"),
]
SCENARIO_IDS = [s[0] for s in SCENARIOS]


def scenario_config(distributed: dict[str, Any], training: dict[str, Any], device: str):
    spec = make_spec(distributed, **training)
    return spec, accelerate_config(spec, device=device, layer_cls=["LlamaDecoderLayer"])


def write_yaml(cfg: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_yaml(cfg))
    return path


# --- accelerate internals, used read-only -----------------------------------------------


def launcher_args(yaml_path: Path, *cli: str) -> Any:
    """The launch args accelerate derives from our YAML (its parser + its validation)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    argv = ["--config_file", str(yaml_path), *cli, "-m", "tests.worker.dump_env", "out"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    return args


def launcher_env_in_process(yaml_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run accelerate's real ``launch_command`` with only the final spawn replaced; return
    the env (and cmd/args) its launcher would give the ranks."""
    from accelerate.commands import launch

    seen: dict[str, Any] = {}

    def deepspeed(args: Any) -> None:  # the real one refuses to run without deepspeed
        seen["cmd"], seen["env"] = launch.prepare_deepspeed_cmd_env(args)
        seen["args"], seen["launcher"] = args, "deepspeed"

    def multi_gpu(args: Any) -> None:
        seen["env"], seen["args"], seen["launcher"] = (
            launch.prepare_multi_gpu_env(args),
            args,
            "multi_gpu",
        )

    def simple(args: Any) -> None:
        seen["cmd"], seen["env"] = launch.prepare_simple_launcher_cmd_env(args)
        seen["args"], seen["launcher"] = args, "simple"

    monkeypatch.setattr(launch, "deepspeed_launcher", deepspeed)
    monkeypatch.setattr(launch, "multi_gpu_launcher", multi_gpu)
    monkeypatch.setattr(launch, "simple_launcher", simple)
    argv = ["--config_file", str(yaml_path), "-m", "tests.worker.dump_env", "out"]
    launch.launch_command(launch.launch_command_parser().parse_args(argv))
    return seen


def args_read_by(func: Any) -> set[str]:
    """Names ``X`` of every ``args.X`` read in a function's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
    }


def launch_parser_dests() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions}


def plugin_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        if k.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(k, v)


# --- real launches -----------------------------------------------------------------------


def launch_dump_env(
    tmp_path: Path,
    cfg: dict[str, Any],
    *,
    extra_env: dict[str, str] | None = None,
    state: bool | str = False,
    main_process_port: int | None = None,
) -> list[dict[str, Any]]:
    """`accelerate launch` exactly as launch_argv builds it, with dump_env in core.train's
    place; returns one record per rank, rank order. ``state``: also build PartialState
    (a string: with that backend)."""
    job_dir = tmp_path / "job"
    write_yaml(cfg, job_dir / "accelerate.yaml")
    out = tmp_path / "out"
    out.mkdir()
    argv = launch_argv(job_dir, main_process_port=main_process_port)
    assert argv[-3:] == ["-m", "core.train", str(job_dir)]
    argv[-2:] = ["tests.worker.dump_env", str(out)]
    if state:
        argv += ["--state"] + ([state] if isinstance(state, str) else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(extra_env or {})
    proc = subprocess.run(
        argv, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


# ===================================== allowlists ========================================


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


# ===================================== YAML shape ========================================


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


# ===================================== launch env / argv =================================


def test_launch_env_ddp_on_cpu_turns_on_accelerate_cpu():
    spec = make_spec({"strategy": "ddp", "num_processes": 2})
    assert launch_env(spec, device="cpu") == {"ACCELERATE_USE_CPU": "true"}
    assert launch_env(spec, device="cuda") == {}


def test_launch_env_carries_nvme_paths():
    assert launch_env(make_spec(DS_Z3_NVME), device="cuda") == {
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "/local_nvme",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "/local_nvme",
    }


def test_launch_argv_runs_core_train_under_accelerate_launch(tmp_path):
    assert launch_argv(tmp_path, python="/venv/bin/python") == [
        "/venv/bin/python",
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path / "accelerate.yaml"),
        "-m",
        "core.train",
        str(tmp_path),
    ]


def test_launch_argv_puts_the_port_before_the_module(tmp_path):
    argv = launch_argv(tmp_path, main_process_port=29611)
    assert argv[0] == sys.executable
    assert argv[5:7] == ["--main_process_port", "29611"]
    assert argv[-3:] == ["-m", "core.train", str(tmp_path)]


def test_launch_argv_is_a_new_list_of_plain_args_each_call(tmp_path):
    first = launch_argv(tmp_path, main_process_port=29611)
    first.append("--junk")
    second = launch_argv(tmp_path, main_process_port=29611)
    assert "--junk" not in second and first is not second
    assert launch_argv(tmp_path) == launch_argv(tmp_path)
    assert all(isinstance(a, str) for a in second)
    # No shell string: the job dir is one argument even with spaces in it.
    spaced = tmp_path / "a dir; rm -rf x"
    assert launch_argv(spaced)[-1] == str(spaced)


def test_launch_argv_refuses_a_bad_port(tmp_path):
    with pytest.raises(ValueError, match="main_process_port"):
        launch_argv(tmp_path, main_process_port=70000)


def test_module_imports_without_torch():
    code = "import sys, worker.run.accelerate_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)


# ===================================== DeepSpeed through accelerate's launcher ===========

DS_CASES = [
    ("z3-cpu-offload", DS_Z3_CPU, {"gradient_accumulation_steps": 4, "mixed_precision": "bf16"}),
    ("z3-nvme", DS_Z3_NVME, {"max_grad_norm": 0.5}),
    ("z2", DS_Z2, {}),
    ("z1-one-process", DS_Z1_ONE_PROCESS, {}),
]


@pytest.mark.parametrize(
    ("name", "distributed", "training"), DS_CASES, ids=[c[0] for c in DS_CASES]
)
def test_deepspeed_env_from_accelerates_launcher_builds_the_asked_plugin(
    name, distributed, training, tmp_path, monkeypatch
):
    from accelerate.utils import DeepSpeedPlugin

    spec = make_spec(distributed, **training)
    for k, v in launch_env(spec, device="cuda").items():
        monkeypatch.setenv(k, v)  # the worker puts these in the launcher's env
    cfg = accelerate_config(spec, device="cuda")
    seen = launcher_env_in_process(write_yaml(cfg, tmp_path / "a.yaml"), monkeypatch)
    env, ds = seen["env"], spec.distributed.deepspeed
    assert seen["launcher"] == "deepspeed"
    assert seen["args"].nproc_per_node == str(spec.distributed.num_processes)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(ds.zero_stage)
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == ds.offload_optimizer_device
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == ds.offload_param_device
    zero3 = ds.zero_stage == 3
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == str(zero3 and ds.zero3_init_flag).lower()
    assert (
        env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"]
        == str(zero3 and ds.zero3_save_16bit_model).lower()
    )
    assert env["ACCELERATE_GRADIENT_CLIPPING"] == str(spec.training.max_grad_norm)
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == str(
        spec.training.gradient_accumulation_steps
    )
    assert env["ACCELERATE_MIXED_PRECISION"] == spec.training.mixed_precision
    assert "ACCELERATE_USE_CPU" not in env

    plugin_env(env, monkeypatch)
    zo = DeepSpeedPlugin().deepspeed_config["zero_optimization"]
    assert zo["stage"] == ds.zero_stage
    assert zo["offload_optimizer"]["device"] == ds.offload_optimizer_device
    assert zo["offload_param"]["device"] == ds.offload_param_device
    nvme = ds.nvme_path if ds.offload_param_device == "nvme" else None
    assert zo["offload_param"]["nvme_path"] == nvme
    assert zo["stage3_gather_16bit_weights_on_model_save"] == (zero3 and ds.zero3_save_16bit_model)


def test_deepspeed_multi_machine_runs_torchrun_per_machine(tmp_path, monkeypatch):
    cfg = accelerate_config(make_spec(DS_MULTI_MACHINE), device="cuda")
    seen = launcher_env_in_process(write_yaml(cfg, tmp_path / "a.yaml"), monkeypatch)
    args = seen["args"]
    assert seen["cmd"] is None  # no pdsh/ssh `deepspeed` command: torchrun on this machine
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "2")
    assert args.rdzv_endpoint == "10.0.0.1:29500"


def test_ddp_multi_machine_rendezvous_at_the_main_process(tmp_path, monkeypatch):
    cfg = accelerate_config(make_spec(DDP_MULTI_MACHINE), device="cuda")
    seen = launcher_env_in_process(write_yaml(cfg, tmp_path / "a.yaml"), monkeypatch)
    args = seen["args"]
    assert seen["launcher"] == "multi_gpu"
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "2")
    assert args.rdzv_endpoint == "10.0.0.1:29555"


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


# ===================================== real launches =====================================


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
