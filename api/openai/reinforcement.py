"""OpenAI's ``method.reinforcement.hyperparameters`` mapped onto ``training.grpo`` (the spec's
GRPO options, core/spec/grpo.py), and back for the job objects this face returns."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.spec.distributed import DistributedSpec

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
