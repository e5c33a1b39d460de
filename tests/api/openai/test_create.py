"""What an OpenAI-style create becomes: the JobSpec it runs as, and what the job object
echoes. Through the official SDK against the API alone (jobs are recorded, not run)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.fine_tuning import FineTuningJob

from core.infra.settings import Settings
from core.spec.catalog import CatalogModel
from tests.api.jobfixtures import fake_run
from tests.utils.api import Api, upload_rows
from tests.utils.samples import OPENAI_DPO, OPENAI_TOOLS, OPENAI_WEIGHTED
from tests.utils.tiny import chat_rows, prompt_completion_rows, reinforcement_rows

BASE_LR = 1e-4


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings, tiny_causal_lm: Path) -> Settings:
    model = api_settings.allowed_model_roots[0] / "tiny-llama"
    shutil.copytree(tiny_causal_lm, model)
    return api_settings.model_copy(update={
        "model_catalog": {"tiny": CatalogModel(location=str(model), learning_rate=BASE_LR),
                          # The tiny model's template writes no tools: this one's does.
                          "tiny-tools": CatalogModel(location=str(model), chat_template="chatml")},
        "tracking_allowed": ["tensorboard", "wandb"],
    })


@pytest.fixture(scope="module")
def sdk(api: Api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key_a, max_retries=0)


def spec_of(api: Api, job_id: str) -> dict[str, Any]:
    return dict(ours(api, job_id)["spec"])


def ours(api: Api, job_id: str) -> dict[str, Any]:
    r = api.client(api.key_a).get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_supervised_create_runs_as_this_spec(api: Api, sdk: openai.OpenAI) -> None:
    train = upload_rows(api.client(api.key_a), chat_rows(40))
    valid = upload_rows(api.client(api.key_a), chat_rows(8, seed=9))
    job = sdk.fine_tuning.jobs.create(
        model="tiny", training_file=train, validation_file=valid, suffix="bot",
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "batch_size": 16, "learning_rate_multiplier": 0.5}}},
        integrations=[{"type": "wandb", "wandb": {"project": "mine", "name": "run-1",
                                                  "tags": ["a"]}}])
    FineTuningJob.model_validate(job.to_dict(), strict=True)
    # n_epochs auto: 40 rows x 3 = 120 >= 100 examples, so 3.
    assert job.hyperparameters.model_dump() == {"batch_size": 16, "n_epochs": 3,
                                                "learning_rate_multiplier": 0.5}
    assert job.integrations is not None and job.integrations[0].wandb.project == "mine"
    spec = spec_of(api, job.id)
    t = spec["training"]
    assert (t["per_device_train_batch_size"], t["gradient_accumulation_steps"]) == (8, 2)
    assert t["learning_rate"] == pytest.approx(BASE_LR * 0.5)
    assert (t["num_train_epochs"], t["save_steps"], t["eval_steps"]) == (3, 3, 3)  # per epoch
    assert spec["dataset"]["eval_file_id"] == valid
    # The format is detected from the rows, and said back on our job object.
    assert spec["dataset"]["format"] == "auto"
    assert ours(api, job.id)["data"]["format"] == "chat"
    assert spec["tracking"]["report_to"] == ["wandb"]
    assert spec["tracking"]["run_name"] == "run-1"
    assert spec["tracking"]["tags"]["wandb.project"] == "mine"
    assert spec["name"] == "bot"


def test_a_prompt_completion_file_and_the_legacy_hyperparameters(api: Api,
                                                                 sdk: openai.OpenAI) -> None:
    train = upload_rows(api.client(api.key_a), prompt_completion_rows(500))
    job = sdk.fine_tuning.jobs.create(model="tiny", training_file=train,
                                      hyperparameters={"n_epochs": 2})
    assert job.method is not None and job.method.type == "supervised"
    # batch_size auto: 0.2% of 500 rows.
    assert (job.hyperparameters.batch_size, job.hyperparameters.n_epochs) == (1, 2)
    assert isinstance(job.seed, int)
    assert ours(api, job.id)["data"]["format"] == "prompt_completion"


def test_the_same_jobs_on_both_apis(api: Api, sdk: openai.OpenAI) -> None:
    ours = {j["id"] for j in api.client(api.key_a).get("/v1/jobs?limit=100").json()["data"]}
    theirs = {j.id for j in sdk.fine_tuning.jobs.list()}
    assert ours == theirs and ours


GRADER = {"type": "string_check", "name": "animal", "input": "{{sample.output_text}}",
          "reference": "{{item.animal}}", "operation": "like"}


def reinforcement(grader: dict[str, Any] | None = None, **hyper: Any) -> dict[str, Any]:
    return {"type": "reinforcement", "reinforcement": {
        "grader": grader or GRADER, "hyperparameters": hyper}}


def test_a_reinforcement_create_runs_as_a_grpo_spec(api: Api, sdk: openai.OpenAI) -> None:
    train = upload_rows(api.client(api.key_a), reinforcement_rows(12))
    valid = upload_rows(api.client(api.key_a), reinforcement_rows(4, seed=8))
    job = sdk.fine_tuning.jobs.create(
        model="tiny", training_file=train, validation_file=valid,
        method=reinforcement(batch_size=3, compute_multiplier=0.5, n_epochs=2,
                             learning_rate_multiplier=2.0, eval_samples="auto",
                             reasoning_effort="default"))
    FineTuningJob.model_validate(job.to_dict(), strict=True)
    assert job.method is not None and job.method.type == "reinforcement"
    rl = job.method.reinforcement
    assert rl is not None and rl.grader.type == "string_check"
    assert rl.grader.model_dump(exclude_none=True) == GRADER
    assert rl.hyperparameters is not None
    # "auto" resolved: 4 answers per prompt; 12 prompts / 3 a step = 4 steps an epoch.
    assert rl.hyperparameters.model_dump() == {
        "batch_size": 3, "n_epochs": 2, "learning_rate_multiplier": 2.0,
        "compute_multiplier": 0.5, "eval_interval": 4, "eval_samples": 4,
        "reasoning_effort": "default"}
    assert job.hyperparameters.model_dump() == {"batch_size": 3, "n_epochs": 2,
                                                "learning_rate_multiplier": 2.0}
    t = spec_of(api, job.id)["training"]
    assert t["objective"] == "grpo" and t["grpo"]["num_generations"] == 4
    assert t["grpo"]["grader"]["reference"] == "{{item.animal}}"
    assert t["per_device_train_batch_size"] == 12  # answers: 3 prompts x 4
    assert t["learning_rate"] == pytest.approx(BASE_LR * 2.0)
    assert (t["num_train_epochs"], t["save_steps"], t["eval_steps"]) == (2, 4, 4)
    assert job.to_dict().get("ftune_notes") is None


def test_reinforcement_values_without_a_meaning_are_refused_or_said_back(
        api: Api, sdk: openai.OpenAI) -> None:
    train = upload_rows(api.client(api.key_a), reinforcement_rows(8))
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="tiny", training_file=train,
                                    method=reinforcement(reasoning_effort="high"))
    assert e.value.param == "method.reinforcement.hyperparameters.reasoning_effort"
    job = sdk.fine_tuning.jobs.create(model="tiny", training_file=train,
                                      method=reinforcement(eval_samples=3))
    (note,) = job.to_dict()["ftune_notes"]  # type: ignore[misc]
    assert note.startswith("method.reinforcement.hyperparameters.eval_samples: held-out")


@pytest.mark.parametrize(("grader", "param"), [
    ({**GRADER, "operation": "equals"}, "method.reinforcement.grader.operation"),
    ({**GRADER, "reference": "{{item.animal"}, "method.reinforcement.grader.reference"),
    ({"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"},
     "method.reinforcement.grader.type"),  # FTUNE_PYTHON_GRADERS is off
    ({"type": "multi", "name": "m", "calculate_output": "a + b",
      "graders": {"a": GRADER}}, "method.reinforcement.grader.calculate_output"),
])
def test_a_bad_grader_is_a_400_naming_its_field(api: Api, sdk: openai.OpenAI,
                                                grader: dict[str, Any], param: str) -> None:
    train = upload_rows(api.client(api.key_a), reinforcement_rows(4))
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="tiny", training_file=train,
                                    method=reinforcement(grader))
    assert e.value.param == param, e.value.body
    assert e.value.code == "invalid_grader"


def test_a_reinforcement_row_without_the_graders_field_is_named(api: Api,
                                                                sdk: openai.OpenAI) -> None:
    rows = reinforcement_rows(4)
    del rows[2]["animal"]
    train = upload_rows(api.client(api.key_a), rows)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="tiny", training_file=train, method=reinforcement())
    assert e.value.param == "training_file"
    assert "row 3" in e.value.message and "animal" in e.value.message


def test_a_grpo_jobspec_reads_as_a_reinforcement_job(api: Api, sdk: openai.OpenAI) -> None:
    train = upload_rows(api.client(api.key_a), reinforcement_rows(8))
    spec = {"model": {"name_or_path": "org/tiny-model"},
            "dataset": {"file_id": train, "format": "chat"},
            "training": {"objective": "grpo", "per_device_train_batch_size": 8,
                         "grpo": {"grader": GRADER, "num_generations": 4}}}
    r = api.client(api.key_a).post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job = sdk.fine_tuning.jobs.retrieve(r.json()["id"])
    FineTuningJob.model_validate(job.to_dict(), strict=True)
    assert job.method is not None and job.method.reinforcement is not None
    assert job.method.reinforcement.hyperparameters is not None
    assert job.method.reinforcement.hyperparameters.batch_size == 2  # 8 answers / 4 a prompt


def test_openais_own_files_are_read_as_they_are(api: Api, sdk: openai.OpenAI) -> None:
    """OpenAI's chat with a weight-0 turn and a tools conversation, and its DPO rows."""
    chat = upload_rows(api.client(api.key_a), [OPENAI_WEIGHTED, OPENAI_TOOLS] * 2)
    with pytest.raises(openai.BadRequestError) as e:  # its template would drop the tools
        sdk.fine_tuning.jobs.create(model="tiny", training_file=chat)
    assert e.value.param == "training_file" and "row 2" in e.value.message
    job = sdk.fine_tuning.jobs.create(model="tiny-tools", training_file=chat)
    assert ours(api, job.id)["data"]["format"] == "chat"
    assert spec_of(api, job.id)["dataset"]["chat_template"] == "chatml"
    prefs = upload_rows(api.client(api.key_a), [OPENAI_DPO] * 4)
    job = sdk.fine_tuning.jobs.create(model="tiny", training_file=prefs,
                                      method={"type": "dpo"})
    assert ours(api, job.id)["data"]["format"] == "preference"


def test_an_ft_model_continues_from_its_job_and_only_for_its_tenant(
        api: Api, sdk: openai.OpenAI) -> None:
    train = upload_rows(api.client(api.key_a), chat_rows(8))
    source = sdk.fine_tuning.jobs.create(model="tiny", training_file=train, suffix="first")
    fake_run(api, source.id, status="succeeded", checkpoints=(2,), adapter=True)
    name = sdk.fine_tuning.jobs.retrieve(source.id).fine_tuned_model
    assert name is not None
    job = sdk.fine_tuning.jobs.create(model=name, training_file=train, suffix="second")
    FineTuningJob.model_validate(job.to_dict(), strict=True)
    assert job.model == name
    spec, first = spec_of(api, job.id), spec_of(api, source.id)
    assert spec["model"]["from_job"] == source.id and spec["model"].get("step") is None
    assert spec["model"]["name_or_path"] == first["model"]["name_or_path"]
    assert spec["peft"] == first["peft"]
    at_step = sdk.fine_tuning.jobs.create(model=f"{name}:ckpt-step-2", training_file=train)
    assert spec_of(api, at_step.id)["model"]["step"] == 2

    other = openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key_b, max_retries=0)
    theirs = upload_rows(api.client(api.key_b), chat_rows(8))
    with pytest.raises(openai.BadRequestError) as e:
        other.fine_tuning.jobs.create(model=name, training_file=theirs)
    assert e.value.param == "model" and "no fine-tuned model of yours" in e.value.message


def test_the_evaluation_extension_is_the_job_specs_and_checked_as_it(
        api: Api, sdk: openai.OpenAI) -> None:
    ev = sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": {
            "type": "object", "properties": {"q": {"type": "string"}}}},
        testing_criteria=[{"type": "string_check", "name": "q", "operation": "eq",
                           "input": "{{item.q}}", "reference": "{{item.q}}"}])
    section = {"evals": [{"eval_id": ev.id, "input_messages": {"type": "template", "template": [
        {"role": "user", "content": "{{item.q}}"}]},
        "source": {"type": "file_content", "content": [{"item": {"q": "x"}}]}}]}
    train = upload_rows(api.client(api.key_a), chat_rows(40))
    job = sdk.fine_tuning.jobs.create(model="tiny", training_file=train,
                                      extra_body={"evaluation": section})
    assert spec_of(api, job.id)["evaluation"]["evals"][0]["eval_id"] == ev.id
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="tiny", training_file=train, extra_body={
            "evaluation": {**section, "select_best": {"eval_id": ev.id, "criterion": "nope"}}})
    assert e.value.param == "evaluation.select_best.criterion", e.value.body
