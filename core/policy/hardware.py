"""What this hardware can run honestly: the worker asks before it builds anything
(worker/run/prepare.py), the accelerate YAML generator refuses to write a config for what it
refuses (worker/run/accelerate_config.py), and the trainer checks again before loading weights
(core/train/job.py: a job directory can be run by hand).

FSDP on CPU: accelerate 1.15 has no supported CPU FSDP. Left alone, an FSDP YAML on a CPU
machine trains one full, unsharded copy per rank and reports success. The trainer can switch
FSDP2 on for real over gloo (core/train/sharding.py: ``enable_cpu_fsdp2``), and then proves the
parameters are sharded; the operator opts in with ``FTUNE_CPU_FSDP2`` (off by default: it
touches a private accelerate attribute). FSDP1 runs the same way (with ACCELERATE_TORCH_DEVICE
cpu, worker/run/accelerate_config.py) but only with sync_module_states false: torch broadcasts
rank 0's weights between GPU tensors only, so every rank reads the weights. Its FULL_STATE_DICT
gather segfaults on CPU (torch ``_flat_param.py``); the trainer never uses it (adapters and full
models are written from FSDP1's sharded state dict, core/train/sharding.py).
"""

from __future__ import annotations

from core.infra.errors import ErrorCode
from core.policy.refusal import Refusal, value_first
from core.spec import JobSpec

_HW = ErrorCode.unsupported_hardware


def cpu_refusal(spec: JobSpec, *, cpu_fsdp2: bool) -> Refusal | None:
    """The first thing in ``spec`` that a CPU-only worker cannot run honestly, or None.

    ``cpu_fsdp2``: the operator lets this worker run FSDP over gloo (FTUNE_CPU_FSDP2; FSDP1
    too, despite the name).
    """
    dist, t = spec.distributed, spec.training
    if dist.strategy == "fsdp":
        if not cpu_fsdp2:
            return value_first(
                _HW,
                "distributed.strategy",
                "fsdp needs a GPU worker: on CPU accelerate does not shard and every process "
                "would train its own full copy (an operator can allow FSDP2 on CPU workers "
                "with FTUNE_CPU_FSDP2)",
            )
        if dist.fsdp.version == 1 and dist.fsdp.sync_module_states:
            # torch's FSDP1 broadcasts module states from rank 0 only between GPU tensors
            # ("The module has CPU parameters or buffers when sync_module_states=True").
            return value_first(
                _HW,
                "distributed.fsdp.sync_module_states",
                "true needs a GPU worker with FSDP1 (torch broadcasts rank 0's weights between "
                "GPU tensors only): on CPU set it and cpu_ram_efficient_loading false (every "
                "rank reads the weights), or use fsdp.version 2 (rank 0 alone reads them)",
            )
    if t.mixed_precision != "no":
        return value_first(
            _HW,
            "training.mixed_precision",
            f"{t.mixed_precision} needs a GPU worker; this run is on cpu "
            "(use mixed_precision no, or submit to a GPU worker)",
        )
    if spec.model.attn_implementation == "flash_attention_2":
        return value_first(_HW, "model.attn_implementation", "flash_attention_2 needs a GPU worker")
    return None


def worker_refusal(spec: JobSpec, gpus: int, *, cpu_fsdp2: bool) -> Refusal | None:
    """What a worker with ``gpus`` GPUs (0: CPU only) on one machine cannot run, or None.

    ``cpu_fsdp2``: the operator lets this worker run FSDP2 on CPU (settings.cpu_fsdp2)."""
    dist = spec.distributed
    if dist.num_machines > 1:
        return Refusal(
            _HW,
            "distributed.num_machines",
            "this worker runs single-machine jobs only",
            text=f"distributed.num_machines={dist.num_machines}: this worker runs "
            "single-machine jobs only",
        )
    if gpus == 0:
        return cpu_refusal(spec, cpu_fsdp2=cpu_fsdp2)
    if dist.processes > gpus:
        return Refusal(
            _HW,
            "distributed.num_processes",
            f"this worker has {gpus} GPU(s)",
            text=f"distributed.num_processes={dist.processes} but this worker has "
            f"{gpus} GPU(s)",
        )
    return None


def device_refusal(
    spec: JobSpec, device: str, *, cuda_available: bool, bf16_ok: bool, cpu_fsdp2: bool
) -> Refusal | None:
    """What the machine the trainer started on cannot run, or None: the run was resolved
    for ``device``; ``cuda_available`` and ``bf16_ok`` are what torch sees here."""
    mp = spec.training.mixed_precision
    if device == "cuda" and cuda_available and mp == "bf16" and not bf16_ok:
        return value_first(_HW, "training.mixed_precision", "bf16 needs an Ampere or newer GPU")
    if device == "cpu":
        return cpu_refusal(spec, cpu_fsdp2=cpu_fsdp2)
    if not cuda_available:
        return value_first(_HW, "runtime.device", "is cuda but no CUDA device is visible")
    return None


def quantization_refusal(spec: JobSpec, *, bitsandbytes_installed: bool) -> Refusal | None:
    """model.quantization needs bitsandbytes (the ``qlora`` extra) where the trainer runs.

    Seen with bitsandbytes 0.50.2 on CPU: 4-bit (nf4, fp4, double quantization, every
    compute dtype) and 8-bit bases both load and train LoRA, so no device is refused here;
    which strategies shard a quantized base is a spec rule (core/spec/)."""
    if spec.model.quantization is not None and not bitsandbytes_installed:
        return value_first(
            _HW,
            "model.quantization",
            "needs bitsandbytes, which this worker does not have installed (pip install "
            "'ftune[qlora]')",
        )
    return None


def bitsandbytes_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def preference_refusal(spec: JobSpec, *, trl_installed: bool) -> Refusal | None:
    """training.objective dpo/orpo/kto trains through TRL (the ``preference`` extra).

    Seen with TRL 1.16: DPO runs under none, DDP, ZeRO-3 and FSDP2 (the CPU route) with
    the same losses as DDP (tests/core/train/test_preference_sharded_runs.py), so no
    strategy is refused here; which data and methods an objective takes is a spec rule."""
    if spec.training.objective != "sft" and not trl_installed:
        return value_first(
            _HW,
            "training.objective",
            f"{spec.training.objective} needs trl, which this worker does not have installed "
            "(pip install 'ftune[preference]')",
        )
    return None


def trl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def runs_cpu_fsdp2(spec: JobSpec, device: str) -> bool:
    """Whether this run is FSDP2 on CPU processes (the trainer's gloo route)."""
    return device == "cpu" and spec.distributed.strategy == "fsdp"
