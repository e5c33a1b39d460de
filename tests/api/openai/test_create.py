"""What an OpenAI-style create becomes: the JobSpec it runs as, and what the job object
echoes. Through the official SDK against the API alone (jobs are recorded, not run)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.fine_tuning import FineTuningJob

from core.catalog import CatalogModel
from core.settings import Settings
from tests.api.conftest import Api, upload_rows
from tests.utils.tiny import chat_rows, prompt_completion_rows

BASE_LR = 1e-4


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings, tiny_causal_lm: Path) -> Settings:
    model = api_settings.allowed_model_roots[0] / "tiny-llama"
    shutil.copytree(tiny_causal_lm, model)
    return api_settings.model_copy(update={
        "model_catalog": {"tiny": CatalogModel(location=str(model), learning_rate=BASE_LR)},
        "tracking_allowed": ["tensorboard", "wandb"],
    })


@pytest.fixture(scope="module")
def sdk(api: Api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key_a, max_retries=0)


def spec_of(api: Api, job_id: str) -> dict[str, Any]:
    r = api.client(api.key_a).get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return dict(r.json()["spec"])


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
    assert spec["dataset"]["format"] == "chat" and spec["dataset"]["eval_file_id"] == valid
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
    assert spec_of(api, job.id)["dataset"]["format"] == "prompt_completion"


def test_the_same_jobs_on_both_apis(api: Api, sdk: openai.OpenAI) -> None:
    ours = {j["id"] for j in api.client(api.key_a).get("/v1/jobs?limit=100").json()["data"]}
    theirs = {j.id for j in sdk.fine_tuning.jobs.list()}
    assert ours == theirs and ours
