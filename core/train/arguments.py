"""spec.training -> the Trainer's arguments (transformers v5 names; TRL's config for the
preference objectives and grpo), and, once the Trainer exists, the check that the strategy
in effect is the one the spec asked for (an accelerate setting that is ignored runs every
rank alone, silently: docs/facts.md)."""

from __future__ import annotations

import os
from typing import Any

from core.infra.errors import strategy_mismatch
from core.run.checkpoints import ResumePlan
from core.train.job import Job
from core.train.sharding import device_arguments, quiet_library_warnings


def training_arguments(job: Job, has_eval: bool, resume: ResumePlan | None = None) -> Any:
    """spec.training -> TrainingArguments (transformers v5 names), or for a preference
    objective TRL's config built on the same values.

    Created before the model is loaded: it initialises the distributed state and, under
    ZeRO-3, registers the config that makes from_pretrained load weights partitioned.
    """
    from transformers import TrainingArguments

    values = training_argument_values(job, has_eval, resume)
    if resume is not None and "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in os.environ:
        # DeepSpeed's plugin (created with these arguments) reads the accumulation the launch
        # wrote: the spec's. A checkpoint resumed on another process count keeps its global
        # batch with another one, and transformers refuses to start DeepSpeed when the two
        # differ ("ds gradient_accumulation_steps=1 vs hf gradient_accumulation_steps=2":
        # a ZeRO-3 checkpoint of 2 processes resumed on 1, as a distributed.resume_on resize
        # runs it, the spec's training section unchanged).
        steps = str(values["gradient_accumulation_steps"])
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = steps
    if job.spec.training.objective == "grpo":
        from core.train.grpo import grpo_config

        return grpo_config(job.spec, values)
    if job.spec.training.objective != "sft":
        from core.train.preference import preference_config

        return preference_config(job.spec, values)
    return TrainingArguments(**values)


def training_argument_values(
    job: Job, has_eval: bool, resume: ResumePlan | None = None
) -> dict[str, Any]:
    """``resume``: a checkpoint taken on another world size sets the batch layout that keeps
    its global batch (core/run/checkpoints.py)."""

    quiet_library_warnings()
    spec, rt = job.spec, job.runtime
    t = spec.training
    if t.eval_steps is not None:
        eval_strategy = "steps"
    elif has_eval:
        eval_strategy = "epoch"  # at least once, when training ends
    else:
        eval_strategy = "no"
    return dict(
        output_dir=str(job.dir.checkpoints),
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,  # > 0 overrides epochs
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        # v5 has no warmup_ratio argument: a warmup_steps value below 1 is read as a
        # fraction of the total optimizer steps (rounded up).
        warmup_steps=t.warmup_ratio,
        weight_decay=t.weight_decay,
        per_device_train_batch_size=resume.per_device_train_batch_size
        if resume
        else t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_eval_batch_size or t.per_device_train_batch_size,
        gradient_accumulation_steps=resume.gradient_accumulation_steps
        if resume
        else t.gradient_accumulation_steps,
        # Recompute activations in backward instead of storing them: ~1/3 more compute for
        # activation memory that no longer grows with depth. Non-reentrant checkpointing
        # works with a frozen base (no input that requires grad is needed).
        activation_checkpointing=t.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False}
        if t.gradient_checkpointing
        else None,
        fp16=t.mixed_precision == "fp16",
        bf16=t.mixed_precision == "bf16",
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
        data_seed=t.seed,
        logging_strategy="steps",
        logging_steps=t.logging_steps,
        logging_first_step=True,
        # The Trainer would otherwise replace a NaN step loss by the running mean and keep
        # training a diverged model; we want to see it and fail.
        logging_nan_inf_filter=False,
        eval_strategy=eval_strategy,
        eval_steps=t.eval_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        neftune_noise_alpha=t.neftune_noise_alpha,
        # use_cpu, or (DeepSpeed) no use_cpu and the gloo backend on a CPU worker.
        **device_arguments(spec.distributed.strategy, rt.device),
        report_to="none",
        disable_tqdm=True,  # trainer.log is a file; progress goes to events.jsonl
        include_num_input_tokens_seen="non_padding",
        # PeftModel's forward takes **kwargs, so the Trainer cannot infer the label column;
        # without this, evaluation silently computes no loss.
        label_names=["labels"],
        remove_unused_columns=False,  # the collator builds exactly the model's inputs
        # LM evaluation needs only the loss; gathering full-vocabulary logits of every eval
        # batch would cost (batch x seq x vocab) memory for nothing.
        prediction_loss_only=spec.model.task != "seq_cls",
        dataloader_pin_memory=rt.device == "cuda",
    )


def strategy_in_effect(trainer: Any) -> tuple[str, int, str]:
    """(strategy, world size, accelerate distributed type) as the Trainer will run it."""
    acc = trainer.accelerator
    dtype = str(getattr(acc.distributed_type, "value", acc.distributed_type))
    world = int(acc.num_processes)
    if trainer.is_deepspeed_enabled:
        strategy = "deepspeed"
    elif trainer.is_fsdp_enabled:
        strategy = "fsdp"
    elif world > 1 and dtype != "NO":
        strategy = "ddp"
    else:
        strategy = "none"
    return strategy, world, dtype


def check_strategy(trainer: Any, job: Job) -> tuple[str, int, str]:
    """Fail unless the run is distributed the way the spec asked.

    accelerate silently degrades: an FSDP YAML on a CPU machine trains unsharded copies, a
    missing --config_file runs one process. Either would "succeed" while being a different
    experiment from the one asked for (and, for FSDP, need far more memory per GPU).
    """
    d = job.spec.distributed
    strategy, world, dtype = strategy_in_effect(trainer)
    want_world = d.processes
    if strategy != d.strategy or world != want_world:
        raise strategy_mismatch(
            f"distributed.strategy {d.strategy} with {want_world} process(es) was asked, but "
            f"{strategy} with world size {world} (accelerate distributed_type {dtype}) is in "
            f"effect. Launch with `accelerate launch --config_file {job.dir.accelerate_config} "
            f"-m core.train {job.dir.root}`."
        )
    return strategy, world, dtype
