"""The distributed sections and accelerate's own launcher that the tests of
worker/run/accelerate_config.py share (tests/worker/run/test_accelerate_*.py): one spec per
strategy and option, the scenarios that cover every option once, accelerate's parser and
launcher run in-process with only the final spawn replaced, and a real `accelerate launch`
of tests/worker/dump_env.py in core.train's place."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from core.spec import JobSpec
from testkit.launch import REPO_ROOT
from tests.utils.specs import parsed_spec
from worker.run.accelerate_config import accelerate_config, launch_argv, render_yaml


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

