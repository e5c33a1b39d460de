"""Names, ids and the results file of the OpenAI face."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

from api.openai.mapping import (
    fine_tuned_model_name,
    job_of_results_file,
    parse_ft_name,
    results_csv,
    results_file_id,
)
from core.db.models import JobEvent


def test_an_ft_name_leads_back_to_its_job_and_checkpoint() -> None:
    name = fine_tuned_model_name("tiny-llama", "acme: research", "bot:v2", "job-abc")
    assert name == "ft:tiny-llama:acme-research:bot-v2:job-abc"
    assert parse_ft_name(name) == parse_ft_name(name.replace("bot-v2", "")) is not None
    found = parse_ft_name(name)
    assert found is not None and (found.job_id, found.step) == ("job-abc", None)
    ckpt = parse_ft_name(f"{name}:ckpt-step-40")
    assert ckpt is not None and (ckpt.job_id, ckpt.step) == ("job-abc", 40)
    assert parse_ft_name("tiny-llama") is None and parse_ft_name("ft:a:b") is None


def test_results_file_ids_round_trip() -> None:
    assert job_of_results_file(results_file_id("job-abc123")) == "job-abc123"
    assert job_of_results_file("file-abc123") is None


def test_results_csv_has_a_row_per_logged_step_with_its_validation_loss() -> None:
    at = datetime(2026, 11, 26, tzinfo=UTC)
    events = [
        JobEvent(id=1, type="progress", created_at=at, data={"step": 1, "loss": 2.5}),
        JobEvent(id=2, type="progress", created_at=at, data={"step": 2}),  # heartbeat
        JobEvent(id=3, type="progress", created_at=at, data={"step": 2, "loss": 2.0}),
        JobEvent(id=4, type="eval", created_at=at, data={"step": 2, "eval_loss": 2.2}),
        JobEvent(id=5, type="log", created_at=at, data={"message": "x"}),
    ]
    rows = list(csv.DictReader(io.StringIO(results_csv(events).decode())))
    assert [(r["step"], r["train_loss"], r["valid_loss"]) for r in rows] == [
        ("1", "2.5", ""), ("2", "2.0", "2.2")]


def test_a_reinforcement_jobs_results_have_its_reward_columns() -> None:
    at = datetime(2026, 11, 26, tzinfo=UTC)
    events = [
        JobEvent(id=1, type="progress", created_at=at,
                 data={"step": 5, "loss": 0.01, "reward": 0.25, "reward_std": 0.4}),
        JobEvent(id=2, type="progress", created_at=at,
                 data={"step": 10, "loss": 0.02, "reward": 0.5, "reward_std": 0.3}),
        JobEvent(id=3, type="eval", created_at=at, data={"step": 10, "reward": 0.45}),
    ]
    rows = list(csv.DictReader(io.StringIO(results_csv(events).decode())))
    assert rows == [
        {"step": "5", "train_loss": "0.01", "train_reward_mean": "0.25",
         "train_reward_std": "0.4", "valid_reward_mean": ""},
        {"step": "10", "train_loss": "0.02", "train_reward_mean": "0.5",
         "train_reward_std": "0.3", "valid_reward_mean": "0.45"}]


def test_steps_with_a_loss_are_metrics_events_and_the_rest_messages() -> None:
    from api.openai.mapping import event_to_openai

    at = datetime(2026, 11, 26, tzinfo=UTC)
    step = event_to_openai(JobEvent(id=7, type="progress", created_at=at, message="",
                                    data={"step": 3, "total_steps": 9, "loss": 1.25}))
    assert (step.id, step.type, step.level, step.created_at) == ("ftevent-7", "metrics", "info",
                                                                 int(at.timestamp()))
    assert step.data == {"step": 3, "total_steps": 9, "train_loss": 1.25}
    valid = event_to_openai(JobEvent(id=8, type="eval", created_at=at, message="",
                                     data={"step": 3, "eval_loss": 1.5}))
    assert (valid.type, valid.data) == ("metrics", {"step": 3, "valid_loss": 1.5})
    failed = event_to_openai(JobEvent(id=9, type="status", created_at=at, message="failed",
                                      data={"status": "failed", "level": "error"}))
    assert (failed.type, failed.level, failed.message) == ("message", "error", "failed")


def test_grpo_steps_and_evaluations_carry_the_reward() -> None:
    from api.openai.mapping import event_to_openai

    at = datetime(2026, 11, 26, tzinfo=UTC)
    step = event_to_openai(JobEvent(id=1, type="progress", created_at=at, message="", data={
        "step": 2, "total_steps": 4, "loss": 0.01, "reward": 0.5, "reward_std": 0.25,
        "completion_length": 7.0, "kl": 0.125}))
    assert step.type == "metrics" and "reward=0.5000" in step.message
    assert step.data == {"step": 2, "total_steps": 4, "train_loss": 0.01,
                         "train_reward_mean": 0.5, "train_reward_std": 0.25,
                         "train_completion_length": 7.0, "train_kl": 0.125}
    valid = event_to_openai(JobEvent(id=2, type="eval", created_at=at, message="",
                                     data={"step": 4, "reward": 0.75}))
    assert (valid.type, valid.data) == ("metrics", {"step": 4, "valid_reward_mean": 0.75})


def test_a_continued_job_is_named_after_the_catalog_model_under_it() -> None:
    from api.openai.mapping import model_name_of

    envelope = {"model": "ft:tiny:acme:first:job-a", "base": "tiny", "suffix": "second"}
    assert model_name_of("job-b", None, {}, envelope, {}, "acme") == "ft:tiny:acme:second:job-b"
