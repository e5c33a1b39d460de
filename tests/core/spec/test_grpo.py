"""training.objective grpo: its options and cross-field rules in one SpecError, and OpenAI's
reinforcement hyperparameters mapped onto our fields."""

from __future__ import annotations

from typing import Any

import pytest

from api.openai.reinforcement import (
    openai_reinforcement_fields,
    openai_reinforcement_hyperparameters,
)
from core.spec import SpecError, parse_job_spec
from tests.utils.specs import spec_body

GRADER = {"type": "string_check", "name": "c", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "eq"}


def spec(**training: Any) -> dict[str, Any]:
    return spec_body(dataset={"file_id": "file-1", "format": "chat"},
                     training={"objective": "grpo", "per_device_train_batch_size": 8,
                               "grpo": {"grader": GRADER, "num_generations": 4}, **training})


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_job_spec(data)
    return {p.param: p.message for p in e.value.problems}


def test_a_grpo_spec_parses() -> None:
    s = parse_job_spec(spec())
    assert s.training.grpo is not None and s.training.grpo.grader.name == "c"


def test_answers_per_step_must_hold_whole_groups() -> None:
    found = problems(spec(per_device_train_batch_size=6))
    assert "must be a multiple of training.grpo.num_generations 4" in \
        found["training.per_device_train_batch_size"]


def test_grpo_needs_its_grader_and_chat_prompts() -> None:
    data = spec()
    del data["training"]["grpo"]
    data["dataset"]["format"] = "prompt_completion"
    found = problems(data)
    assert "needs training.grpo" in found["training.grpo"]
    assert "learns from format chat" in found["dataset.format"]


def test_grpo_options_without_the_objective_are_refused() -> None:
    data = spec(objective="sft")
    assert "only for objective grpo" in problems(data)["training.grpo"]


def test_a_bad_grader_is_named_by_its_path_in_the_spec() -> None:
    data = spec()
    data["training"]["grpo"]["grader"] = {**GRADER, "operation": "startswith"}
    assert "eq" in problems(data)["training.grpo.grader.operation"]


def test_grpo_trains_lora_ia3_or_full_and_names_them_otherwise() -> None:
    for method in ("lora", "ia3", "full"):
        assert parse_job_spec({**spec(), "peft": {"method": method}}).peft.method == method
    found = problems({**spec(), "peft": {"method": "prompt_tuning"}})
    assert found["peft.method"] == "objective grpo needs lora, ia3 or full, not prompt_tuning"


def test_sharded_strategies_are_refused() -> None:
    data = spec()
    data["distributed"] = {"strategy": "deepspeed", "num_processes": 2}
    assert "strategy none or ddp" in problems(data)["distributed.strategy"]


def test_openai_hyperparameters_map_onto_our_fields() -> None:
    fields, notes = openai_reinforcement_fields({
        "n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 3.0, "eval_interval": 10,
        "compute_multiplier": 0.5, "eval_samples": "auto", "reasoning_effort": "auto",
    }, num_processes=2)
    assert fields == {
        "training.grpo.num_generations": 4,
        "training.num_train_epochs": 2.0,
        "training.per_device_train_batch_size": 8,  # 4 prompts x 4 answers over 2 processes
        "training.learning_rate": pytest.approx(3e-5),
        "training.eval_steps": 10,
    }
    assert notes == []


def test_openai_values_without_a_meaning_here_are_refused_or_said_back() -> None:
    _, notes = openai_reinforcement_fields({"reasoning_effort": "high", "eval_samples": 3,
                                            "seed_of_luck": 1})
    found = {n.param: n for n in notes}
    assert found["hyperparameters.reasoning_effort"].refused
    assert "not supported" in found["hyperparameters.reasoning_effort"].message
    assert not found["hyperparameters.eval_samples"].refused
    assert str(found["hyperparameters.seed_of_luck"]) == \
        "hyperparameters.seed_of_luck: unknown, refused"
    _, none = openai_reinforcement_fields({"reasoning_effort": "default"})
    assert none == []


def test_a_grpo_spec_reads_back_as_openais_hyperparameters() -> None:
    fields, _ = openai_reinforcement_fields({"batch_size": 3, "compute_multiplier": 0.5,
                                             "learning_rate_multiplier": 2.0},
                                            base_learning_rate=1e-4)
    spec = {"training": {"per_device_train_batch_size":
                         fields["training.per_device_train_batch_size"],
                         "learning_rate": fields["training.learning_rate"],
                         "grpo": {"num_generations": fields["training.grpo.num_generations"]}}}
    assert openai_reinforcement_hyperparameters(spec, 1e-4) == {
        "batch_size": 3, "n_epochs": 1, "learning_rate_multiplier": 2.0,
        "compute_multiplier": 0.5, "eval_interval": None, "eval_samples": 4}
