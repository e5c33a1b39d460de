"""JobSpec -> accelerate launch config (YAML mapping), launch env and argv.

Pure functions that write what the run policy (core/policy/) allowed; they inspect no model.
accelerate 1.15 silently ignores misspelled keys inside ``fsdp_config`` and
``deepspeed_config``, and ``accelerate launch``, ``accelerate config`` and
``TrainingArguments`` disagree on defaults, so every key we write is explicit and comes from
the allowlists below. tests/worker/run/test_accelerate_allowlists.py checks each allowlisted
key against accelerate's own launcher code, and test_accelerate_launches.py launches
``accelerate launch`` with the generated YAML to see the environment it hands to every rank.

What accelerate 1.15's launcher does with a YAML (commands/launch.py, utils/launch.py):

* Top-level keys are checked (unknown -> ValueError) and copied onto the launch args only
  where the argparse default is ``None``. ``same_network``, ``rdzv_backend``,
  ``enable_cpu_affinity`` and ``downcast_bf16`` have non-None argparse defaults, so their
  YAML values are ignored; we write exactly those defaults so the file never says something
  the launcher does not do.
* ``fsdp_config`` keys become ``FSDP_*`` env vars in ``prepare_multi_gpu_env``; the
  ``FullyShardedDataParallelPlugin`` on each rank reads them. FSDP1 reads
  ``FSDP_SHARDING_STRATEGY``; FSDP2 reads ``FSDP_RESHARD_AFTER_FORWARD`` (bool) and ignores
  sharding strategy, backward/forward prefetch, use_orig_params and sync_module_states.
* ``deepspeed_config`` keys become ``ACCELERATE_DEEPSPEED_*`` / ``ACCELERATE_GRADIENT_*`` in
  ``prepare_deepspeed_cmd_env`` -- except the two NVMe paths, which that function never
  exports (the DeepSpeedPlugin reads them from env). ``launch_env`` supplies them.
* ``distributed_type: MULTI_CPU`` goes to the simple launcher, which starts ONE process
  unless an mpirun hostfile is configured. CPU DDP therefore uses ``MULTI_GPU`` (torchrun);
  the YAML's ``use_cpu`` is not exported by that path, so ``launch_env`` sets
  ``ACCELERATE_USE_CPU=true``, without which each rank runs alone (distributed_type NO).
* With ``use_cpu``/``ACCELERATE_USE_CPU`` accelerate turns DeepSpeed off (AcceleratorState
  only enables it ``if not cpu``), so DeepSpeed never gets use_cpu, even on a CPU worker.
  There the trainer passes ``ddp_backend="gloo"`` instead (core/train/sharding.py; without
  it every CPU rank is process 0 of 1) and ``launch_env`` sets ``DS_ACCELERATOR=cpu``.
  Verified for real (tests/core/train/test_deepspeed_runs.py): ZeRO-2 with CPU optimizer
  offload and ZeRO-3 with CPU optimizer + parameter offload train LoRA on 2 CPU processes.
* FSDP1 on CPU (the operator's FTUNE_CPU_FSDP2 route) also needs ``ACCELERATE_TORCH_DEVICE=cpu``:
  accelerate hands FSDP1 its device as ``device_id``, and without the variable a CPU rank asks
  for an accelerator. ``launch_env`` sets it.
* HYBRID_SHARD / HYBRID_SHARD_ZERO2 (FSDP1) go through ``fsdp_sharding_strategy`` like the
  other strategies; ``fsdp_activation_checkpointing_offload`` is FSDP2-only (the plugin
  raises otherwise; core/spec/checks.py refuses it first).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from core.policy import cpu_refusal
from core.run.jobdir import ACCELERATE_FILE
from core.spec import DeepSpeedSpec, FsdpSpec, JobSpec, SpecError, spec_problems

DEVICES = ("cpu", "cuda")

# ClusterConfig fields we write (TPU, SageMaker, megatron, fp8, mpirun and parallelism keys
# are deliberately absent).
TOP_LEVEL_KEYS = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "mixed_precision",
        "use_cpu",
        "debug",
        "num_processes",
        "num_machines",
        "machine_rank",
        "gpu_ids",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "enable_cpu_affinity",
        "downcast_bf16",
        "dynamo_config",
        "fsdp_config",
        "deepspeed_config",
    }
)

# Keys of ``fsdp_config``: launch-arg names that prepare_multi_gpu_env turns into FSDP_* env.
FSDP_KEYS = frozenset(
    {
        "fsdp_version",
        "fsdp_sharding_strategy",  # FSDP1 only
        "fsdp_reshard_after_forward",  # FSDP2 only
        "fsdp_offload_params",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",  # TRANSFORMER_BASED_WRAP only
        "fsdp_min_num_params",  # SIZE_BASED_WRAP only
        "fsdp_backward_prefetch",  # FSDP1 only (the docs' "fsdp_backward_prefetch_policy" is read by nothing)
        "fsdp_forward_prefetch",  # FSDP1 only
        "fsdp_state_dict_type",
        "fsdp_cpu_ram_efficient_loading",
        "fsdp_sync_module_states",  # FSDP1 only
        "fsdp_use_orig_params",  # FSDP1 only
        "fsdp_activation_checkpointing",
        "fsdp_activation_checkpointing_offload",
    }
)

# Keys of ``deepspeed_config``: launch-arg names read by prepare_deepspeed_cmd_env ...
DEEPSPEED_KEYS = frozenset(
    {
        "zero_stage",
        "offload_optimizer_device",
        "offload_param_device",
        "offload_optimizer_nvme_path",
        "offload_param_nvme_path",
        "zero3_init_flag",
        "zero3_save_16bit_model",
        "gradient_clipping",
        "gradient_accumulation_steps",
        "deepspeed_multinode_launcher",  # only with num_machines > 1
    }
)
# ... except these, which accelerate 1.15 accepts in the YAML but never exports to the ranks.
DEEPSPEED_KEYS_NOT_EXPORTED = frozenset({"offload_optimizer_nvme_path", "offload_param_nvme_path"})
NVME_PATH_ENV = {
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
}

DYNAMO_KEYS = frozenset({"dynamo_backend"})

# The launcher's argparse defaults for keys whose YAML value it ignores (see module doc).
RDZV_BACKEND = "static"
SAME_NETWORK = False
# Without a port in the spec, a single machine lets accelerate pick a free one (0), so two
# jobs on one worker never collide; several machines must agree on a port.
FREE_PORT = 0
DEFAULT_MULTI_MACHINE_PORT = 29500

DISTRIBUTED_TYPE = {"none": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}


class AccelerateConfigError(ValueError):
    """The spec cannot run as asked on this worker; ``param`` names the spec field."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}")


class FsdpLayerClassError(AccelerateConfigError):
    def __init__(self, message: str) -> None:
        super().__init__("distributed.fsdp.transformer_layer_cls_to_wrap", message)


def accelerate_config(
    spec: JobSpec,
    *,
    device: str,
    gpu_ids: Sequence[int] | None = None,
    layer_cls: Sequence[str] | None = None,
    cpu_fsdp2: bool = False,
) -> dict[str, Any]:
    """The full accelerate YAML mapping for ``spec`` on a worker with ``device``.

    ``gpu_ids``: the GPUs of this worker the job may use (one per local process); None: all.
    ``layer_cls``: FSDP layer classes to wrap when the spec leaves them to the model's default
    (the run policy finds them: ``core.policy.fsdp_wrap_classes``); the spec's own list wins.
    ``cpu_fsdp2``: the operator allows FSDP2 on CPU (the trainer shards over gloo, see
    core/policy/hardware.py); the YAML is the GPU one, ``launch_env`` adds ACCELERATE_USE_CPU.
    """
    problems = spec_problems(spec)
    if problems:
        raise SpecError(problems)
    dist = spec.distributed
    strategy = dist.strategy
    if device not in DEVICES:
        raise AccelerateConfigError(
            "device", f"must be one of {', '.join(DEVICES)}, not {device!r}"
        )
    if device == "cpu":
        refusal = cpu_refusal(spec, cpu_fsdp2=cpu_fsdp2)
        if refusal is not None:
            raise AccelerateConfigError(refusal.param, refusal.message)
    num_processes = dist.processes
    if num_processes % dist.num_machines:
        raise AccelerateConfigError(
            "distributed.num_processes",
            f"{num_processes} processes do not split evenly over {dist.num_machines} machines",
        )
    local_processes = dist.processes_per_node

    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": DISTRIBUTED_TYPE[strategy],
        "mixed_precision": spec.training.mixed_precision,
        # Only the one-process launcher exports use_cpu (ddp gets it from launch_env), and
        # DeepSpeed must never see it: accelerate then disables DeepSpeed.
        "use_cpu": device == "cpu" and strategy in ("none", "ddp"),
        "debug": False,
        "num_processes": num_processes,
        "num_machines": dist.num_machines,
        "gpu_ids": _gpu_ids(gpu_ids, device, local_processes),
        "enable_cpu_affinity": False,
        "downcast_bf16": False,
        "dynamo_config": {"dynamo_backend": "NO"},
    }
    if strategy != "none":
        cfg["machine_rank"] = dist.machine_rank
        cfg["same_network"] = SAME_NETWORK
        cfg["rdzv_backend"] = RDZV_BACKEND
        if dist.main_process_port is not None:
            cfg["main_process_port"] = dist.main_process_port
        elif dist.num_machines == 1:
            cfg["main_process_port"] = FREE_PORT
        else:
            cfg["main_process_port"] = DEFAULT_MULTI_MACHINE_PORT
        if dist.num_machines > 1:
            cfg["main_process_ip"] = dist.main_process_ip
    if strategy == "fsdp":
        cfg["fsdp_config"] = _fsdp_config(dist.fsdp, layer_cls)
    if strategy == "deepspeed":
        cfg["deepspeed_config"] = _deepspeed_config(
            dist.deepspeed,
            grad_accum=spec.training.gradient_accumulation_steps,
            max_grad_norm=spec.training.max_grad_norm,
            multi_machine=dist.num_machines > 1,
        )
    _check_allowlisted(cfg)
    return cfg


def _gpu_ids(gpu_ids: Sequence[int] | None, device: str, local_processes: int) -> str:
    if gpu_ids is None:
        return "all"
    if device == "cpu":
        raise AccelerateConfigError("gpu_ids", "a CPU worker has no GPUs to choose")
    ids = list(gpu_ids)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise AccelerateConfigError("gpu_ids", f"must be non-negative integers, not {ids}")
    if len(set(ids)) != len(ids):
        raise AccelerateConfigError("gpu_ids", f"has duplicates: {ids}")
    if len(ids) != local_processes:
        raise AccelerateConfigError(
            "gpu_ids", f"{len(ids)} GPUs given for {local_processes} processes on this machine"
        )
    return ",".join(str(i) for i in ids)


def _fsdp_config(f: FsdpSpec, layer_cls: Sequence[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "fsdp_version": f.version,
        "fsdp_offload_params": f.offload_params,
        "fsdp_auto_wrap_policy": f.auto_wrap_policy,
        "fsdp_state_dict_type": f.state_dict_type,
        "fsdp_cpu_ram_efficient_loading": f.cpu_ram_efficient_loading,
        "fsdp_activation_checkpointing": f.activation_checkpointing,
        "fsdp_activation_checkpointing_offload": f.activation_checkpointing_offload,
    }
    if f.version == 1:
        out["fsdp_sharding_strategy"] = f.sharding_strategy
        out["fsdp_backward_prefetch"] = f.backward_prefetch
        out["fsdp_forward_prefetch"] = f.forward_prefetch
        out["fsdp_sync_module_states"] = f.sync_module_states
        out["fsdp_use_orig_params"] = f.use_orig_params
    else:
        # FSDP2 has no sharding strategies: FULL_SHARD frees the gathered parameters after
        # forward (re-gathers for backward), SHARD_GRAD_OP keeps them until backward is done.
        out["fsdp_reshard_after_forward"] = f.sharding_strategy == "FULL_SHARD"
    if f.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        classes = list(f.transformer_layer_cls_to_wrap or layer_cls or [])
        if not classes:
            raise FsdpLayerClassError(
                "TRANSFORMER_BASED_WRAP needs layer classes: give them, or pass the model's "
                "default (core.policy.fsdp_layer_classes)"
            )
        out["fsdp_transformer_layer_cls_to_wrap"] = ",".join(classes)
    elif f.auto_wrap_policy == "SIZE_BASED_WRAP":
        out["fsdp_min_num_params"] = f.min_num_params
    return out


def _deepspeed_config(
    z: DeepSpeedSpec, *, grad_accum: int, max_grad_norm: float, multi_machine: bool
) -> dict[str, Any]:
    zero3 = z.zero_stage == 3
    out: dict[str, Any] = {
        "zero_stage": z.zero_stage,
        "offload_optimizer_device": z.offload_optimizer_device,
        "offload_param_device": z.offload_param_device,
        # accelerate reads both flags at every stage; below ZeRO-3 they can only be false.
        "zero3_init_flag": z.zero3_init_flag and zero3,
        "zero3_save_16bit_model": z.zero3_save_16bit_model and zero3,
        "gradient_clipping": max_grad_norm if z.gradient_clipping is None else z.gradient_clipping,
        "gradient_accumulation_steps": grad_accum,
    }
    if z.offload_optimizer_device == "nvme":
        out["offload_optimizer_nvme_path"] = z.nvme_path
    if z.offload_param_device == "nvme":
        out["offload_param_nvme_path"] = z.nvme_path
    if multi_machine:
        # One `accelerate launch` per machine (torchrun), not the ssh-based pdsh default.
        out["deepspeed_multinode_launcher"] = "standard"
    return out


def _check_allowlisted(cfg: dict[str, Any]) -> None:
    for key, allowed in (
        ("", TOP_LEVEL_KEYS),
        ("fsdp_config", FSDP_KEYS),
        ("deepspeed_config", DEEPSPEED_KEYS),
        ("dynamo_config", DYNAMO_KEYS),
    ):
        keys = set(cfg) if not key else set(cfg.get(key, {}))
        unknown = keys - allowed
        if unknown:  # a bug here, not a user error
            raise AssertionError(f"not allowlisted in {key or 'top level'}: {sorted(unknown)}")


def launch_env(spec: JobSpec, *, device: str) -> dict[str, str]:
    """Environment to add to the launcher's own (accelerate copies it to every rank): what the
    YAML cannot carry through accelerate 1.15's launcher."""
    env: dict[str, str] = {}
    strategy = spec.distributed.strategy
    if device == "cpu" and strategy in ("none", "ddp", "fsdp"):
        # torchrun ranks only get use_cpu this way; without it each rank trains alone. For
        # FSDP2 on CPU the trainer then turns the MULTI_CPU state into FSDP (sharding.py).
        env["ACCELERATE_USE_CPU"] = "true"
    if device == "cpu" and strategy == "fsdp" and spec.distributed.fsdp.version == 1:
        # FSDP1 moves every unit to accelerate's device (device_id): without this it asks
        # for an accelerator that a CPU machine does not have.
        env["ACCELERATE_TORCH_DEVICE"] = "cpu"
    if strategy == "deepspeed":
        if device == "cpu":
            # DeepSpeed's own accelerator choice, made explicit: it would guess CPU only
            # because no GPU answers, and a GPU visible to a CPU job must not change that.
            env["DS_ACCELERATOR"] = "cpu"
        z = spec.distributed.deepspeed
        if z.offload_optimizer_device == "nvme" and z.nvme_path:
            env[NVME_PATH_ENV["offload_optimizer_nvme_path"]] = z.nvme_path
        if z.offload_param_device == "nvme" and z.nvme_path:
            env[NVME_PATH_ENV["offload_param_nvme_path"]] = z.nvme_path
    return env


def render_yaml(cfg: dict[str, Any]) -> str:
    """Stable YAML text: sorted keys, block style, strings like 'no'/'NO' quoted."""
    return yaml.safe_dump(cfg, sort_keys=True, default_flow_style=False)


def launch_argv(
    job_dir: Path,
    *,
    python: str = sys.executable,
    main_process_port: int | None = None,
    module: str = "core.train",
) -> list[str]:
    """A new argv list each call: `accelerate launch` of ``module`` (the trainer) on ``job_dir``."""
    argv = [
        python,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(Path(job_dir) / ACCELERATE_FILE),
    ]
    if main_process_port is not None:
        if isinstance(main_process_port, bool) or not 0 <= main_process_port <= 65535:
            raise ValueError(f"main_process_port must be 0..65535, not {main_process_port!r}")
        argv += ["--main_process_port", str(main_process_port)]
    argv += ["-m", module, str(job_dir)]
    return argv
