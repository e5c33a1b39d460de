"""worker.run.accelerate_config's launch env and argv, and what accelerate's launcher makes of
the YAML without starting anything: its own ``launch_command`` runs in-process with only the
final spawn replaced (routing, YAML parsing and ``prepare_deepspeed_cmd_env`` are real), and
the resulting env is fed to accelerate's ``DeepSpeedPlugin``. accelerate's DeepSpeed launcher
refuses to start without the deepspeed package (an optional install), so DeepSpeed configs are
checked this way too; tests/worker/run/test_accelerate_launches.py launches them for real."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testkit.launch import REPO_ROOT
from tests.utils.launch_configs import (
    DDP_MULTI_MACHINE,
    DS_MULTI_MACHINE,
    DS_Z1_ONE_PROCESS,
    DS_Z2,
    DS_Z3_CPU,
    DS_Z3_NVME,
    launcher_env_in_process,
    make_spec,
    plugin_env,
    write_yaml,
)
from worker.run.accelerate_config import (
    accelerate_config,
    launch_argv,
    launch_env,
)


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
