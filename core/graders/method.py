"""training.objective grpo: its options (``training.grpo``), the checks that relate them to
the rest of the spec, and OpenAI's reinforcement hyperparameters mapped onto them.

GRPO (Group Relative Policy Optimization, TRL's GRPOTrainer): for every prompt the policy
samples ``num_generations`` answers, the grader scores each, and each answer's advantage is
its reward minus the group's mean (divided by the group's std with scale_rewards group).
The loss raises the log-probability of the answers that beat their group; ``beta`` > 0
adds a KL penalty against the reference (the base with the adapter disabled). Importable
without torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.graders.spec import Grader

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
    grpo; typed Any because core.spec imports this module)."""
    out: list[tuple[str, str]] = []
    t, d = spec.training, spec.distributed
    g = t.grpo
    if g is None:
        return [("training.grpo", "objective grpo needs training.grpo with a grader")]
    processes = 1 if d.strategy == "none" else d.num_processes
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


# ---------------------------------------------------------------------------- OpenAI

# OpenAI's reinforcement hyperparameters that have a meaning here.
OPENAI_HYPERPARAMETERS = (
    "n_epochs", "batch_size", "learning_rate_multiplier", "eval_interval", "eval_samples",
    "compute_multiplier", "reasoning_effort",
)
BASE_LEARNING_RATE = 1e-5
BASE_GENERATIONS = 8
# reasoning_effort values that ask for nothing (OpenAI's SDK says "default"; "auto" elsewhere).
NO_REASONING_EFFORT = (None, "auto", "default")


@dataclass(frozen=True)
class OpenAINote:
    """One value of OpenAI's hyperparameters that is not run as asked: ``refused`` ones
    must fail the request (naming ``param``), the others are said back to the user."""

    param: str  # e.g. "hyperparameters.reasoning_effort"
    message: str
    refused: bool

    def __str__(self) -> str:
        return f"{self.param}: {self.message}"


def openai_reinforcement_fields(
    hp: dict[str, Any], num_processes: int = 1, base_learning_rate: float = BASE_LEARNING_RATE
) -> tuple[dict[str, Any], list[OpenAINote]]:
    """OpenAI's ``method.reinforcement.hyperparameters`` -> our spec fields (dotted paths
    -> values), and what was not run as asked (refused or said back).

    * n_epochs -> training.num_train_epochs
    * batch_size (prompts per step) -> per_device_train_batch_size = batch_size x
      num_generations / processes (our batch counts answers)
    * learning_rate_multiplier -> training.learning_rate = multiplier x base_learning_rate
      (1e-5; the OpenAI face passes the catalog model's rate, as for its other methods)
    * eval_interval -> training.eval_steps; eval_samples -> training.grpo.num_generations
      used on held-out prompts is the same as in training, so eval_samples sets the
      answers per held-out prompt only when it equals num_generations (else said back)
    * compute_multiplier -> training.grpo.num_generations = round(8 x multiplier), >= 2
    * reasoning_effort: no meaning for the models trained here; refused unless unset,
      "auto" or "default".
    "auto" values keep our defaults.
    """
    fields: dict[str, Any] = {}
    notes: list[OpenAINote] = []

    def given(name: str) -> Any:
        v = hp.get(name)
        return None if v is None or v == "auto" else v

    for name in sorted(set(hp) - set(OPENAI_HYPERPARAMETERS)):
        notes.append(OpenAINote(f"hyperparameters.{name}", "unknown, refused", refused=True))
    generations = BASE_GENERATIONS
    if given("compute_multiplier") is not None:
        generations = max(2, round(BASE_GENERATIONS * float(given("compute_multiplier"))))
        fields["training.grpo.num_generations"] = generations
    if given("n_epochs") is not None:
        fields["training.num_train_epochs"] = float(given("n_epochs"))
    if given("batch_size") is not None:
        answers = int(given("batch_size")) * generations
        if answers % num_processes:
            notes.append(OpenAINote(
                "hyperparameters.batch_size", f"{given('batch_size')} prompts x {generations} "
                f"answers do not split over {num_processes} processes", refused=False))
        fields["training.per_device_train_batch_size"] = max(1, answers // num_processes)
    if given("learning_rate_multiplier") is not None:
        fields["training.learning_rate"] = float(given("learning_rate_multiplier")) * base_learning_rate
    if given("eval_interval") is not None:
        fields["training.eval_steps"] = int(given("eval_interval"))
    if given("eval_samples") is not None and int(given("eval_samples")) != generations:
        notes.append(OpenAINote(
            "hyperparameters.eval_samples", f"held-out prompts get num_generations "
            f"({generations}) answers each, not {given('eval_samples')}", refused=False))
    if hp.get("reasoning_effort") not in NO_REASONING_EFFORT:
        notes.append(OpenAINote(
            "hyperparameters.reasoning_effort", "not supported (the models trained here have "
            "no reasoning effort); leave it unset or default", refused=True))
    return fields, notes


def openai_reinforcement_hyperparameters(spec: dict[str, Any],
                                         base_learning_rate: float) -> dict[str, Any]:
    """The inverse: a grpo JobSpec (as stored, a dict) in OpenAI's reinforcement
    hyperparameters, every value a number (what a job object echoes, "auto" resolved).
    eval_interval is None when the job has no held-out prompts."""
    from core.spec.distributed import DistributedSpec  # core.spec imports this module

    t = spec.get("training", {})
    g = t.get("grpo") or {}
    generations = int(g.get("num_generations", BASE_GENERATIONS))
    processes = DistributedSpec.model_validate(spec.get("distributed") or {}).processes
    answers = (int(t.get("per_device_train_batch_size", 8))
               * int(t.get("gradient_accumulation_steps", 1)) * processes)
    return {
        "batch_size": max(1, answers // generations),
        "n_epochs": math.ceil(float(t.get("num_train_epochs", 1.0))),
        "learning_rate_multiplier": round(float(t.get("learning_rate", base_learning_rate))
                                          / base_learning_rate, 6),
        "compute_multiplier": generations / BASE_GENERATIONS,
        "eval_interval": t.get("eval_steps"),
        "eval_samples": generations,
    }
