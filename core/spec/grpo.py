"""training.objective grpo: its options (``training.grpo``) and the checks that relate them
to the rest of the spec (OpenAI's reinforcement hyperparameters are mapped onto them by
api/openai/reinforcement.py).

GRPO (Group Relative Policy Optimization, TRL's GRPOTrainer): for every prompt the policy
samples ``num_generations`` answers, the grader scores each, and each answer's advantage is
its reward minus the group's mean (divided by the group's std with scale_rewards group).
The loss raises the log-probability of the answers that beat their group; ``beta`` > 0
adds a KL penalty against the reference (the base with the adapter disabled). Importable
without torch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.spec.graders import Grader

# TRL 1.16 GRPOConfig.loss_type values that work with token-level importance sampling.
GrpoLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo"]


class GrpoSpec(BaseModel):
    """Options of objective grpo (TRL's GRPOConfig names)."""

    model_config = ConfigDict(extra="forbid")

    grader: Grader = Field(
        description="What scores each answer (OpenAI's grader shape: string_check, "
        "text_similarity, python, score_model, multi); rewards are in [0, 1]."
    )
    num_generations: int = Field(
        default=8, ge=2, le=256,
        description="Answers sampled per prompt; per_device_train_batch_size x processes x "
        "gradient_accumulation_steps (answers per step) must be a multiple of it.",
    )
    max_completion_length: int = Field(
        default=256, ge=1, le=32_768, description="Most tokens generated per answer."
    )
    temperature: float = Field(default=1.0, gt=0, le=2, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling of answers.")
    beta: float = Field(
        default=0.0, ge=0, le=10,
        description="KL coefficient against the reference (the base: the adapter disabled, "
        "or a frozen copy for peft method full); 0 skips the reference pass (TRL's default) "
        "and reports no KL.",
    )
    loss_type: GrpoLossType = Field(
        default="dapo", description="TRL's loss aggregation: dapo (default), grpo, dr_grpo, "
        "bnpo, cispo, sapo.",
    )
    epsilon: float = Field(default=0.2, gt=0, le=1, description="Clipping range of the ratio.")
    num_iterations: int = Field(
        default=1, ge=1, le=16, description="Optimisation passes over each generated batch."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group", description="Divide advantages by the std of the group, batch, or not."
    )
    samples_per_log: int = Field(
        default=4, ge=0, le=64,
        description="Sampled answers (with their scores) reported at each logging step.",
    )


def grpo_problems(spec: Any) -> list[tuple[str, str]]:
    """(param, message) pairs for a grpo spec (a core.spec.JobSpec, whose objective is
    grpo; typed Any because core/spec/job.py imports this module through training.py)."""
    out: list[tuple[str, str]] = []
    t, d = spec.training, spec.distributed
    g = t.grpo
    if g is None:
        return [("training.grpo", "objective grpo needs training.grpo with a grader")]
    processes = d.processes
    answers = t.per_device_train_batch_size * processes * t.gradient_accumulation_steps
    if answers % g.num_generations:
        out.append((
            "training.per_device_train_batch_size",
            (f"answers per step (per_device_train_batch_size {t.per_device_train_batch_size} x "
            f"{processes} process(es) x gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps} = {answers}) must be a multiple of "
            f"training.grpo.num_generations {g.num_generations}"),
        ))
    has_eval = (spec.dataset.eval_file_id is not None or spec.dataset.eval_path is not None
                or spec.dataset.eval_split > 0)
    eval_batch = (t.per_device_eval_batch_size or t.per_device_train_batch_size) * processes
    if has_eval and eval_batch % g.num_generations:
        out.append((
            "training.per_device_eval_batch_size",
            (f"held-out prompts are scored with num_generations {g.num_generations} answers "
            f"each: the eval batch ({eval_batch} over all processes) must be a multiple of it"),
        ))
    if d.strategy in ("fsdp", "deepspeed"):
        out.append(("distributed.strategy", ("objective grpo runs with strategy none or ddp "
                    "(generation under FSDP/ZeRO-3 is not tested here)")))
    if spec.dataset.max_seq_length <= 8:
        out.append(("dataset.max_seq_length", "too short for a prompt"))
    if t.early_stopping_patience is not None:
        out.append(("training.early_stopping_patience", ("watches eval_loss, which grpo does "
                    "not compute (it reports eval_reward)")))
    return out
