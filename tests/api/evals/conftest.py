"""The Evals API through the official SDK against the real API over HTTP; runs are recorded
when queued and executed by calling the worker's code (core/evals/execute.py) directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from core.evals.execute import execute_run
from core.infra.settings import Settings
from core.spec.catalog import CatalogModel
from tests.utils.api import Api


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings) -> Settings:
    model = api_settings.allowed_model_roots[0] / "tiny"
    return api_settings.model_copy(update={
        "model_catalog": {"tiny": CatalogModel(location=str(model))},
        "python_graders": True,
        "eval_heartbeat_seconds": 0.2,
    })


@pytest.fixture(scope="module")
def queued(api: Api) -> Iterator[list[str]]:
    """The run ids the API queued, in order."""
    ids: list[str] = []
    api.app.state.eval_enqueue = ids.append
    yield ids
    api.app.state.eval_enqueue = None


@pytest.fixture(scope="module")
def sdk(api: Api, queued: list[str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key_a, max_retries=0)


@pytest.fixture(scope="module")
def sdk_b(api: Api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key_b, max_retries=0)


def execute(api: Api, run_id: str, **settings: Any) -> str:
    """What a worker's task does with the run."""
    s = api.settings.model_copy(update=settings) if settings else api.settings
    return execute_run(api.maker, run_id, worker_id="test-worker", settings=s)


QA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["question", "answer"],
}
EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "operation": "eq"}


def qa_eval(sdk: openai.OpenAI, *criteria: dict[str, Any], schema: dict[str, Any] | None = None,
            name: str = "qa") -> Any:
    return sdk.evals.create(
        name=name,
        data_source_config={"type": "custom", "item_schema": schema or QA_SCHEMA,
                            "include_sample_schema": True},
        testing_criteria=list(criteria) or [EXACT])  # type: ignore[arg-type]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
