"""Eval runs on the real stack: the official SDK against the API process, the run executed
by a Celery worker process that got the run's message through the broker."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from testkit.faultstack import FaultStack
from testkit.wait import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    data_dir = tmp_path_factory.mktemp("evals-stack")
    st = FaultStack(data_dir=data_dir, workers=1, env_overrides={
        "DATABASE_URL": f"sqlite:///{data_dir / 'ftune.db'}",
        "BROKER_URL": "filesystem://",
        "FTUNE_WORKER_GPUS": "0",
        "FTUNE_HEARTBEAT_SECONDS": "0.5",
        "FTUNE_PYTHON_GRADERS": "true",
        "FTUNE_MODEL_CATALOG": json.dumps({"tiny": {"location": str(data_dir)}}),
        "FTUNE_ENGINE_VENV": str(data_dir / "no-engine"),  # no worker can serve a model
    })
    st.start()
    yield st
    st.stop()


def test_a_worker_runs_a_queued_eval_run(stack: FaultStack) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, max_retries=0)
    ev = sdk.evals.create(
        data_source_config={"type": "custom", "include_sample_schema": True,
                            "item_schema": {"type": "object",
                                            "properties": {"answer": {"type": "string"}}}},
        testing_criteria=[{"type": "python", "name": "py", "pass_threshold": 1.0,
                           "source": "def grade(sample, item):\n"
                                     "    return float(sample['output_text'] == item['answer'])\n"}])
    rows = [{"item": {"answer": a}, "sample": {"output_text": g}}
            for a, g in (("4", "4"), ("6", "5"), ("8", "8"))]
    run = sdk.evals.runs.create(ev.id, data_source={
        "type": "jsonl", "source": {"type": "file_content", "content": rows}})
    done = wait_until(lambda: (r := sdk.evals.runs.retrieve(run.id, eval_id=ev.id)).status
                      in ("completed", "failed") and r, 120, "the worker to run it")
    assert done.status == "completed", done.error
    assert done.result_counts.model_dump() == {"total": 3, "passed": 2, "failed": 1,
                                               "errored": 0}
    assert done.attempt == 1


def test_a_model_no_engine_can_serve_fails_the_run_saying_so(stack: FaultStack) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, max_retries=0)
    ev = sdk.evals.create(
        data_source_config={"type": "custom", "include_sample_schema": True,
                            "item_schema": {"type": "object",
                                            "properties": {"q": {"type": "string"}}}},
        testing_criteria=[{"type": "string_check", "name": "any", "operation": "like",
                           "input": "{{sample.output_text}}", "reference": ""}])
    run = sdk.evals.runs.create(ev.id, data_source={
        "type": "completions", "model": "tiny",
        "input_messages": {"type": "template", "template": [
            {"role": "user", "content": "{{item.q}}"}]},
        "source": {"type": "file_content", "content": [{"item": {"q": "hi"}}]}})
    done = wait_until(lambda: (r := sdk.evals.runs.retrieve(run.id, eval_id=ev.id)).status
                      in ("completed", "failed") and r, 120, "the worker to end it")
    assert (done.status, done.error.code) == ("failed", "engine_unavailable")
    assert "make engine" in done.error.message
