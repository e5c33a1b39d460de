"""Does a full fine-tune fit the GPUs that would run it?

Full fine-tuning (peft method full) holds weights, gradients and optimizer state for every
parameter: 16 bytes per parameter with Adam and mixed precision, over 1 TB for a 70B model.
Whether that fits one GPU is arithmetic (core/model/estimate.py ``Estimate.gpu_state_mb``), not a
guess, so a job that cannot fit is refused at submit (against the registered fleet) and at
claim (against the worker's own GPUs) instead of running out of memory after its model
loaded. Activations are only an order-of-magnitude estimate: they are reported in the
message, never the reason for a refusal. Adapter methods are not checked here: their
training state is a small fraction of the frozen base.

Pure: a spec, its estimate and GPU memory in, a Refusal or None out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.infra.errors import ErrorCode
from core.policy.refusal import Refusal
from core.spec import JobSpec

if TYPE_CHECKING:
    from core.model.estimate import Estimate


def shards_everything(spec: JobSpec) -> bool:
    """Whether weights, gradients and optimizer state are all split over the processes
    (FSDP FULL_SHARD / HYBRID_SHARD, ZeRO-3), so more processes means less per process."""
    d = spec.distributed
    if d.strategy == "fsdp":
        return d.fsdp.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
    return d.strategy == "deepspeed" and d.deepspeed.zero_stage == 3


def memory_refusal(spec: JobSpec, est: Estimate, gpu_memory_mb: int) -> Refusal | None:
    """Why a full fine-tune of ``spec`` does not fit GPUs of ``gpu_memory_mb`` MiB, or None
    (also when the memory is unknown: 0, or the method is not full)."""
    if spec.peft.method != "full" or gpu_memory_mb <= 0 or est.gpu_state_mb <= gpu_memory_mb:
        return None
    d = spec.distributed
    need = (
        f"full fine-tuning holds {est.gpu_state_mb:,.0f} MiB per process (weights "
        f"{est.gpu_weights_mb:,.0f}, gradients and optimizer state "
        f"{est.gpu_training_state_mb:,.0f}; activations about {est.gpu_activations_mb:,.0f} "
        f"more) but a GPU has {gpu_memory_mb:,} MiB"
    )
    # Processes needed when weights, gradients and optimizer state are all sharded.
    processes = math.ceil(est.state_total_mb / gpu_memory_mb)
    if shards_everything(spec):
        return Refusal(
            ErrorCode.unsupported_hardware,
            "distributed.num_processes",
            f"{d.num_processes} processes: {need}; at least {processes} processes of this "
            "size are needed",
        )
    how = {
        "none": "one process holds everything",
        "ddp": "DDP keeps a whole copy on every process",
        "fsdp": f"FSDP {d.fsdp.sharding_strategy} does not shard the weights",
        "deepspeed": f"ZeRO stage {d.deepspeed.zero_stage} does not shard the weights",
    }[d.strategy]
    return Refusal(
        ErrorCode.unsupported_hardware,
        "distributed.strategy",
        f"{d.strategy}: {how}: {need}; use fsdp with FULL_SHARD or deepspeed zero_stage 3 "
        f"over at least {processes} processes of this size",
    )


def fleet_memory_refusal(
    spec: JobSpec, est: Estimate, memories: Sequence[int]
) -> Refusal | None:
    """``memories``: the GPU memory (MiB, 0 unknown) of each worker that could otherwise
    run ``spec``. Refused only when every one of them is known to be too small; the message
    is for the largest."""
    if not memories or any(m <= 0 for m in memories):
        return None
    return memory_refusal(spec, est, max(memories))


def fit_refusal(
    spec: JobSpec, model_path: str, memories: Sequence[int], *, trust_remote_code: bool = False
) -> Refusal | None:
    """``fleet_memory_refusal`` with the estimate built here from the model's config at
    ``model_path`` (a resolved location) on the meta device: no weights read. None without
    anything to check (not full, memory unknown). Raises OSError/ValueError when the config
    cannot be read (the caller's model checks say so)."""
    if spec.peft.method != "full" or not memories or any(m <= 0 for m in memories):
        return None
    import transformers

    from core.model.estimate import estimate

    config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return fleet_memory_refusal(spec, estimate(spec, config=config), memories)
