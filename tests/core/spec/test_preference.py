"""training.objective dpo/orpo/kto: which data format each learns from, the preference
options each reads, and what they cannot combine with (each rule names its field)."""

from __future__ import annotations

from typing import Any

import pytest

from core.spec import SpecError, parse_job_spec


def body(objective: str, fmt: str = "preference", **training: Any) -> dict[str, Any]:
    return {
        "model": {"name_or_path": "org/tiny"},
        "dataset": {"file_id": "file-1", "format": fmt},
        "training": {"objective": objective, **training},
    }


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_job_spec(data)
    return {p.param: p.message for p in e.value.problems}


def test_sft_is_the_default_and_dpo_takes_trl_defaults() -> None:
    spec = parse_job_spec({"model": {"name_or_path": "o/m"}, "dataset": {"file_id": "f"}})
    assert (spec.training.objective, spec.training.preference) == ("sft", None)
    # No format named: detected from the rows among the objective's (core/data/formats).
    assert spec.dataset.format == "auto"
    spec = parse_job_spec(body("dpo", preference={"loss_type": "ipo", "beta": 0.5}))
    q = spec.training.preference
    assert q is not None and (q.loss_type, q.beta, q.label_smoothing) == ("ipo", 0.5, 0.0)


@pytest.mark.parametrize(
    ("objective", "fmt", "want"),
    [("dpo", "kto", "preference"), ("orpo", "chat", "preference"), ("kto", "preference", "kto")],
)
def test_each_objective_names_the_format_it_learns_from(objective: str, fmt: str, want: str) -> None:
    got = problems(body(objective, fmt, per_device_train_batch_size=2))
    assert got == {"dataset.format": f"objective {objective} learns from format {want}, not {fmt}"}


def test_preference_data_needs_a_preference_objective() -> None:
    got = problems(body("sft", "kto", preference={"beta": 0.2}))
    assert got["dataset.format"] == "kto data needs training.objective kto"
    assert "it would be ignored" in got["training.preference"]


def test_every_combination_problem_in_one_error() -> None:
    data = body(
        "dpo",
        neftune_noise_alpha=5.0,
        preference={"kto_loss_type": "apo_zero_unpaired", "label_smoothing": 0.1},
    )
    data["model"]["task"] = "seq2seq_lm"
    data["peft"] = {"method": "prefix_tuning"}
    data["dataset"]["packing"] = True
    assert set(problems(data)) == {
        "training.objective",  # causal_lm only
        "peft.method",  # lora or ia3: the reference is the adapter disabled
        "dataset.packing",
        "dataset.format",  # seq2seq_lm does not learn from preference (task rule)
        "training.neftune_noise_alpha",
        "training.preference.kto_loss_type",  # kto only
        "training.preference.label_smoothing",  # loss_type robust or exo_pair only
    }


def test_dpo_loss_types_are_trls() -> None:
    got = problems(body("dpo", preference={"loss_type": "simpo"}))
    assert "training.preference.loss_type" in got and "'sigmoid'" in got["training.preference.loss_type"]
    assert parse_job_spec(body("dpo", preference={"loss_type": "robust", "label_smoothing": 0.1}))


def test_kto_needs_two_rows_per_micro_batch_for_its_kl_term() -> None:
    got = problems(body("kto", "kto", per_device_train_batch_size=1))
    assert "KL" in got["training.per_device_train_batch_size"]
    ok = body("kto", "kto", per_device_train_batch_size=1,
              preference={"kto_loss_type": "apo_zero_unpaired"})
    assert parse_job_spec(ok).training.preference is not None
