"""What the trainer does differently under DeepSpeed and FSDP, in one place.

* ``device_arguments``: the TrainingArguments that pick the device and process-group
  backend. DeepSpeed must never get ``use_cpu`` (accelerate's PartialState then skips
  DeepSpeed's own ``init_distributed`` and reports MULTI_CPU, while AcceleratorState later
  says DEEPSPEED: two different answers to "how is this run distributed"). On a CPU worker it
  needs ``ddp_backend="gloo"`` instead: without a backend accelerate finds no device type
  and treats every CPU rank as process 0 of 1.
* ``check_sharding``: after the Trainer exists, compare the ZeRO / FSDP settings in effect
  (what accelerate built from the launcher's environment) with the spec, and that ZeRO-3
  created the base weights partitioned (TrainingArguments before from_pretrained). The
  fields it returns go into the "started" event.
* ``enable_cpu_fsdp2``: FSDP2 over gloo on CPU processes, which accelerate 1.15 does not
  offer (core/policy/hardware.py says when it is allowed). ``fsdp_sharded`` proves after the model
  was prepared that every rank holds only its slice of the parameters.
* ``prepared_sharding``: as training begins, on every rank, the proof above, ZeRO-3's fp32
  master copy dropped (``alias_fp32_master``) and each rank's parameter bytes.
* ``quiet_library_warnings``: torch 2.13 deprecates the collective names DeepSpeed 0.19
  calls on every step; the FutureWarning would fill trainer.log with two lines per step
  per rank.

Pure Python at import time (torch and deepspeed are imported inside functions).
"""

from __future__ import annotations

import warnings
from typing import Any

from core.infra.errors import strategy_mismatch
from core.spec import JobSpec


def device_arguments(strategy: str, device: str) -> dict[str, Any]:
    """``use_cpu`` / ``ddp_backend`` for TrainingArguments."""
    if strategy == "deepspeed":
        # DeepSpeed picks its CPU accelerator by itself when no GPU is visible (launch_env
        # also sets DS_ACCELERATOR=cpu); the process group must be gloo there.
        return {"use_cpu": False, "ddp_backend": "gloo" if device == "cpu" else None}
    if strategy == "fsdp" and device == "cpu":
        # Keep the state enable_cpu_fsdp2 prepared: without use_configured_state the
        # TrainingArguments reset it and build a plain MULTI_CPU (DDP) state.
        return {"use_cpu": True, "accelerator_config": {"use_configured_state": True}}
    return {"use_cpu": device == "cpu"}


def enable_cpu_fsdp2() -> None:
    """Make accelerate build FSDP on CPU processes; call before TrainingArguments.

    accelerate only switches to FSDP from the MULTI_GPU state (AcceleratorState), and a CPU
    process group is MULTI_CPU, so an FSDP YAML on CPU silently trains unsharded copies. The
    process group itself (gloo, from the launcher's ACCELERATE_USE_CPU) is what FSDP2 needs:
    its collectives (all-gather, reduce-scatter) run on gloo. So the shared state is created
    as CPU and relabelled MULTI_GPU; AcceleratorState then attaches the FSDP plugin built
    from the launcher's FSDP_* variables. This writes a private attribute of accelerate:
    ``fsdp_sharded`` checks the result on every run, so an upgrade that changes the
    mechanism fails the job (strategy_mismatch) instead of training unsharded.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise strategy_mismatch(
            "FSDP on CPU needs a multi-process CPU launch (accelerate launch with "
            f"ACCELERATE_USE_CPU=true), but accelerate's state is {state.distributed_type}"
        )
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def local_param_bytes(model: Any) -> int:
    """Bytes of parameter storage this rank holds: the local shard of an FSDP2 (DTensor) or
    ZeRO-3 (``ds_tensor``) parameter, nothing for one on the meta device."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            t = p.to_local()
        else:
            t = getattr(p, "ds_tensor", p)
        if t.device.type != "meta":
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state (e.g. Adam's two moments) this rank holds: its shard under
    FSDP2 (DTensor state) and ZeRO (the optimizer over this rank's flat partition)."""
    from torch import Tensor
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:  # accelerate / DeepSpeed wrap the real one
        seen.add(id(opt))
        state = getattr(opt, "state", None)
        if isinstance(state, dict) and state:
            total = 0
            for per_param in state.values():
                for t in per_param.values() if isinstance(per_param, dict) else ():
                    if isinstance(t, DTensor):
                        t = t.to_local()
                    if isinstance(t, Tensor) and t.dim() > 0:  # not the step counters
                        total += t.numel() * t.element_size()
            return total
        opt = getattr(opt, "optimizer", None)
    return 0


def fsdp_sharded(model: Any, world_size: int, version: int = 2) -> dict[str, Any]:
    """Prove FSDP sharding on a prepared model, or raise strategy_mismatch.

    FSDP2: the parameters are DTensors, and each rank's local shard of the largest one is
    smaller than the whole tensor (about 1/world). FSDP1 (GPU only) keeps its shards in
    FlatParameters behind FullyShardedDataParallel units: at least one such unit must wrap
    the model.
    """
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        units = sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        if not units:
            raise strategy_mismatch(
                "FSDP1 was asked, but no FullyShardedDataParallel unit wraps the prepared "
                "model: every rank trains a full copy"
            )
        return {"fsdp_units": units}
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if not dtensors:
        raise strategy_mismatch(
            f"FSDP was asked, but none of the {len(params)} parameters is sharded (no DTensor "
            "after the model was prepared): every rank trains a full copy"
        )
    largest = max(dtensors, key=lambda p: p.numel())
    local, whole = largest.to_local().numel(), largest.numel()
    if world_size > 1 and local >= whole:
        raise strategy_mismatch(
            f"FSDP was asked, but the largest parameter is whole on this rank ({local} of "
            f"{whole} elements) with world size {world_size}"
        )
    return {
        "fsdp_sharded_params": len(dtensors),
        "fsdp_unsharded_params": len(params) - len(dtensors),
        "fsdp_largest_param_local_fraction": round(local / whole, 4),
    }


def fsdp1_wrapped(model: Any) -> bool:
    """Whether FSDP1 (FullyShardedDataParallel units) wraps ``model``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def fsdp1_state_dtensors(wrapped: Any, *, trainable_only: bool) -> dict[str, Any]:
    """FSDP1's model state as each rank holds it, by plain parameter name: every tensor that
    FSDP1 shards is this rank's row chunk of it, as a DTensor over all ranks (``Shard(0)``),
    the rest (buffers) whole. ``trainable_only``: leave out frozen parameters.

    torch's SHARDED_STATE_DICT unflattens one FSDP unit at a time and hands back each
    tensor's row chunk as a ShardedTensor; as DTensors they go through the same code as
    FSDP2's parameters (DCP's Hugging Face writer, ``full_tensor()``, the read-back). Not
    FULL_STATE_DICT: it gathers everything to rank 0, and its gather crashed on CPU (torch
    ``_flat_param.py``, offload_to_cpu on tensors already on the CPU). Raises ValueError for
    a layout that is not a row split."""
    import torch
    import torch.distributed as tdist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    state = get_model_state_dict(
        wrapped,
        options=StateDictOptions(full_state_dict=False, ignore_frozen_params=trainable_only),
    )
    chunks = [t.local_shards() for t in state.values() if isinstance(t, ShardedTensor)]
    device = next((c[0].tensor.device.type for c in chunks if c), "cpu")
    mesh = init_device_mesh(device, (tdist.get_world_size(),))
    out: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(value, ShardedTensor):
            out[name] = value
            continue
        shape = torch.Size(value.metadata().size)
        want_shape, want_offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        shards = value.local_shards()
        if shards:
            local, offset = shards[0].tensor, list(shards[0].metadata.shard_offsets)
        else:  # more ranks than rows: this one holds none
            local = torch.empty(want_shape, dtype=value.dtype, device=device)
            offset = list(want_offset)
        if len(shards) > 1 or tuple(local.shape) != tuple(want_shape) or offset != list(
            want_offset
        ):
            raise ValueError(
                f"FSDP1 sharded {name} in an unexpected layout: {len(shards)} local shards, "
                f"shape {tuple(local.shape)} at {offset}; a row split gives "
                f"{tuple(want_shape)} at {list(want_offset)}"
            )
        stride = torch.empty(shape, device="meta").stride()
        out[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
        )
    return out


def quiet_library_warnings() -> None:
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
        r"deprecated",
        category=FutureWarning,
    )


def _zero_config(trainer: Any) -> dict[str, Any]:
    plugin = trainer.accelerator.state.deepspeed_plugin
    return dict(plugin.deepspeed_config.get("zero_optimization") or {})


def size_buckets_to_model(trainer: Any) -> None:
    """Let the Trainer size ZeRO's communication buckets from the model's hidden size (its
    ``auto`` values: hidden^2 for the reduce bucket; under ZeRO-3 0.9 hidden^2 to prefetch
    and 10 hidden to keep small parameters whole). accelerate's plugin, built from the
    launch's environment, names none of them, so DeepSpeed's defaults applied: a reduce
    bucket of 5e8 elements, 1.9 GB per rank in float32 whatever the model (bench/sharding.py
    --method full measured it on a 142M model). Keys an operator set are left alone."""
    zero = trainer.accelerator.state.deepspeed_plugin.deepspeed_config.setdefault(
        "zero_optimization", {}
    )
    zero.setdefault("reduce_bucket_size", "auto")
    if int(zero.get("stage", 0)) == 3:
        zero.setdefault("stage3_prefetch_bucket_size", "auto")
        zero.setdefault("stage3_param_persistence_threshold", "auto")


def zero_buckets(engine: Any) -> dict[str, int]:
    """The bucket sizes (elements) a DeepSpeed engine runs with, from its parsed config."""
    out = {"zero_reduce_bucket_size": int(engine.zero_reduce_bucket_size())}
    if engine.zero_optimization_stage() == 3:
        out["zero_prefetch_bucket_size"] = int(engine.zero_prefetch_bucket_size())
        out["zero_param_persistence_threshold"] = int(engine.zero_param_persistence_threshold())
    return out


def alias_fp32_master(optimizer: Any) -> int:
    """Under ZeRO-3 without optimizer offload, let each fp32 master partition be the rank's
    float32 parameter partition itself, as DeepSpeed means to; the bytes this freed (0 when
    nothing applied). Called once the engine exists (and, resuming, has loaded its state).

    DeepSpeed 0.19's ``_create_fp32_partitions`` (runtime/zero/stage3.py) skips the master
    copy when a partition already has the master's dtype and device ("we don't need another
    copy of the weights"), but tests ``partition.device == self.device`` with ``self.device``
    the accelerator's device *name* (a str: ``current_device_name()``), and a torch.device
    never equals a str, so it always clones: a float32 run holds its weights twice (a 4th
    copy of the parameters per rank, 2 of the 10 bytes per parameter and rank that
    bench/sharding.py --method full measured on 2 processes, against 8 under FSDP2). The
    rest of DeepSpeed already expects the alias: the step ends with
    ``fp16_partitioned_groups_flat[i].data.copy_(fp32_partitioned_groups_flat[i].data)``,
    commented as a no-op for aliases. Only partitions equal in dtype, device, shape and
    values are aliased, so nothing a run computes changes; with optimizer offload (the
    master on the CPU, the partitions on the accelerator) or half-precision partitions, or
    NVMe-swapped sub-groups, the master is a real second copy and stays."""
    import torch

    zero = optimizer
    seen: set[int] = set()
    while zero is not None and id(zero) not in seen and not hasattr(
        zero, "fp32_partitioned_groups_flat"
    ):
        seen.add(id(zero))
        zero = getattr(zero, "optimizer", None)
    if zero is None or not hasattr(zero, "fp16_partitioned_groups_flat"):
        return 0  # not ZeRO-3 (stage 1/2 keep their own flat groups)
    if getattr(zero, "offload_optimizer", False):
        return 0
    freed = 0
    pairs = zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat, strict=True)
    for i, (part, master) in enumerate(pairs):
        if part is None or master is part or zero._swappable_optimizer_subgroup(i):
            continue
        if (master.dtype, master.device, master.shape) != (part.dtype, part.device, part.shape):
            continue
        if master.untyped_storage().data_ptr() == part.untyped_storage().data_ptr():
            continue
        if not torch.equal(master, part):
            continue
        freed += master.untyped_storage().nbytes()
        # The optimizer's parameter (and its state, keyed by that object) stay; only its
        # storage becomes the partition's.
        master.data = part.data
    return freed


def _device(section: Any) -> str:
    if not isinstance(section, dict):
        return "none"
    return str(section.get("device") or "none")


def base_partitioned(model: Any) -> bool:
    """Whether the frozen base weights (every weight, in a full fine-tune) are ZeRO-3
    partitioned (created under zero.Init)."""
    params = [p for p in model.parameters() if not p.requires_grad] or list(model.parameters())
    return bool(params) and all(hasattr(p, "ds_id") for p in params)


def deepspeed_in_effect(trainer: Any) -> dict[str, Any]:
    zo = _zero_config(trainer)
    plugin = trainer.accelerator.state.deepspeed_plugin
    return {
        "zero_stage": int(zo.get("stage", 0)),
        "offload_optimizer_device": _device(zo.get("offload_optimizer")),
        "offload_param_device": _device(zo.get("offload_param")),
        "zero3_init": bool(plugin.zero3_init_flag),
        "params_partitioned_at_load": base_partitioned(trainer.model),
        "process_group_backend": _backend(),
    }


def fsdp_in_effect(trainer: Any) -> dict[str, Any]:
    plugin = trainer.accelerator.state.fsdp_plugin
    sd_type = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
    return {
        "fsdp_version": int(plugin.fsdp_version),
        "fsdp_state_dict_type": sd_type,
        "fsdp_offload_params": type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
        or bool(getattr(plugin.cpu_offload, "offload_params", False)),
    }


def _backend() -> str | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return None


def check_sharding(trainer: Any, spec: JobSpec) -> dict[str, Any]:
    """The sharding settings in effect (for the "started" event); fail when they are not
    the ones the spec asked for. Call after ``check_strategy`` (the strategy itself is
    right by then)."""
    d = spec.distributed
    if d.strategy == "deepspeed":
        got = deepspeed_in_effect(trainer)
        z = d.deepspeed
        want = {
            "zero_stage": z.zero_stage,
            "offload_optimizer_device": z.offload_optimizer_device,
            "offload_param_device": z.offload_param_device,
        }
        wrong = {k: (v, got[k]) for k, v in want.items() if got[k] != v}
        if wrong:
            raise strategy_mismatch(
                "DeepSpeed is not configured as the spec asks: "
                + ", ".join(f"{k} {w!r} asked, {g!r} in effect" for k, (w, g) in wrong.items())
                + ". The accelerate YAML of this job does not match its spec.json."
            )
        if z.zero_stage == 3 and z.zero3_init_flag and not got["params_partitioned_at_load"]:
            raise strategy_mismatch(
                "ZeRO-3 with zero3_init_flag was asked, but the base model was loaded whole on "
                "every rank (TrainingArguments must exist before from_pretrained)"
            )
        return got
    if d.strategy == "fsdp":
        got = fsdp_in_effect(trainer)
        f = d.fsdp
        if got["fsdp_version"] != f.version or got["fsdp_state_dict_type"] != f.state_dict_type:
            raise strategy_mismatch(
                f"FSDP is not configured as the spec asks: version {f.version} / "
                f"{f.state_dict_type} asked, version {got['fsdp_version']} / "
                f"{got['fsdp_state_dict_type']} in effect"
            )
        return got
    return {}


def prepared_sharding(model: Any, started: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """On every rank as training begins (the model is wrapped and sharded by now): prove
    FSDP sharding, drop ZeRO-3's redundant fp32 master copy (alias_fp32_master), and
    report the parameter bytes each rank holds (one collective). ``started``: the started
    event's fields (strategy, world size, FSDP version)."""
    from core.train import dist

    fields: dict[str, Any] = {}
    if started.get("strategy") == "fsdp":
        version = int(started["fsdp_version"])
        fields.update(fsdp_sharded(model, int(started["world_size"]), version))
    if started.get("strategy") == "deepspeed":
        aliased = alias_fp32_master(optimizer)
        fields["zero_fp32_master_aliased_mb"] = round(aliased / 2**20, 3)
    per_rank = dist.gather_objects(local_param_bytes(model))
    fields["param_mb_per_rank"] = [round(b / 2**20, 3) for b in per_rank]
    return fields
