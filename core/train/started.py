"""The "started" event: what runs, said once the Trainer exists and the strategy in effect
is checked (core/train/recipe.py ``setup``): the distributed layout, the precision, the
method and what peft resolved, the batch, where the run resumed from, and the data read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from core.run.checkpoints import ResumePlan
from core.train.job import Job


def started_fields(
    job: Job,
    model: Any,
    args: Any,
    data: Any,
    *,
    world: int,
    distributed_type: str,
    strategy: str,
    sharding: dict[str, Any],
    quantization: dict[str, Any],
    params: tuple[int, int],
    lm_head: str,
    packing: str | None,
    generation_eval: bool,
    resume: ResumePlan | None,
    universal_seconds: float | None,
) -> dict[str, Any]:
    """The started event's fields (the callback emits them as "started" on train begin)."""
    spec, rt, t = job.spec, job.runtime, job.spec.training
    trainable, total = params
    return {
        "job_id": rt.job_id,
        "attempt": rt.attempt,
        "world_size": world,
        # Machines that joined the rendezvous: torchrun's agents, one per machine.
        "num_machines": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        "distributed_type": distributed_type,
        "strategy": strategy,
        **sharding,
        "device": rt.device,
        "mixed_precision": t.mixed_precision,
        **quantization,
        "task": spec.model.task,
        "objective": spec.training.objective,
        "method": spec.peft.method,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        # Where the loss's logits are computed: "fused" (labelled positions only, in
        # tiles: core/train/loss.py), "fused, every position (why)" or "plain (why)".
        "lm_head": lm_head,
        "packing": packing,  # None, or how packed rows reach attention: mask|flat|position_ids
        "generation_eval": generation_eval,
        # What peft resolved `peft.target_modules` to (None: its per-architecture default;
        # "all-linear"): the spec that ran, as the API shows it.
        "target_modules": resolved_target_modules(model),
        "trainable_params": int(trainable),
        "total_params": int(total),
        "per_device_train_batch_size": int(args.per_device_train_batch_size),
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "effective_batch_size": int(args.per_device_train_batch_size)
        * int(args.gradient_accumulation_steps)
        * world,
        "resumed_from": _relative(rt.resume_from_checkpoint, job.dir.root),
        # model.from_job: its adapter (rt.init_adapter) or, full, its weights (rt.model_path).
        "initialized_from": {"job": spec.model.from_job, "step": spec.model.step}
        if spec.model.from_job
        else None,
        **(resume.event_fields(strategy, world) if resume else {}),
        **({"universal_checkpoint_seconds": universal_seconds}
           if universal_seconds is not None else {}),
        **data.train.stats.as_event(),
        # The format read (detected or named), the columns used and ignored.
        "data": data.receipt.to_dict() if data.receipt else None,
        "eval_rows": data.eval.stats.rows if data.eval else 0,
        "eval_examples": len(data.eval) if data.eval else 0,
    }


def resolved_target_modules(model: Any) -> list[str] | str | None:
    """The modules the adapter was injected into, as peft resolved the spec's
    target_modules (a regex string stays a string)."""
    config = getattr(model, "peft_config", {}).get("default")
    modules = getattr(config, "target_modules", None)
    if modules is None or isinstance(modules, str):
        return modules
    return sorted(str(m) for m in modules)


def _relative(path: Path | None, root: Path) -> str | None:
    if path is None:
        return None
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)
