"""Eval runs through ftune's own deployments, and evaluation inside fine-tuning, on the real
stack the serving module uses (tests/utils/serving_stack.py: one engine for both): one
OpenAI fine-tuning job, created with the official SDK and the ``evaluation`` extension
(extra_body), teaches a tiny Llama one sentence; after training its worker scores the base
model, each kept checkpoint and the final model with real eval runs through the base model's
vLLM deployment, and select_best makes the best checkpoint the job's result. Then the SDK's
own completions runs on the catalog model, the ft: name and a checkpoint name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai.types.evals import RunListResponse, RunRetrieveResponse
from openai.types.fine_tuning import FineTuningJob

from testkit.faultstack import FaultStack
from testkit.wait import wait_until
from tests.utils.serving_stack import BASE, sdk
from tests.utils.tiny import sentences, write_jsonl

pytestmark = pytest.mark.e2e

TAUGHT = "the cat sat on the mat"
ITEMS = 4
CRITERION = "says-at"  # "cat", "sat", "mat": a taught answer says some of them


@dataclass(frozen=True)
class Judged:
    client: openai.OpenAI
    stack: FaultStack
    eval_id: str
    job: FineTuningJob
    content: list[dict[str, Any]]

    def native(self, path: str) -> Any:
        r = httpx.get(f"{self.stack.url}/v1{path}", timeout=30,
                      headers={"Authorization": f"Bearer {self.stack.api_key}"})
        assert r.status_code == 200, r.text
        return r.json()


def finished_run(client: openai.OpenAI, eval_id: str, run_id: str) -> RunRetrieveResponse:
    done = wait_until(lambda: (r := client.evals.runs.retrieve(run_id, eval_id=eval_id))
                      .status in ("completed", "failed", "canceled") and r, timeout=600,
                      what="the run", every=1)
    return RunRetrieveResponse.model_validate(done.to_dict(), strict=True)


@pytest.fixture(scope="module")
def judged(serving_stack: FaultStack, tmp_path_factory: pytest.TempPathFactory) -> Judged:
    client = sdk(serving_stack)
    ev = client.evals.create(
        name="taught",
        data_source_config={"type": "custom", "include_sample_schema": True, "item_schema": {
            "type": "object", "required": ["question", "expected"],
            "properties": {"question": {"type": "string"}, "expected": {"type": "string"}}}},
        testing_criteria=[{"type": "string_check", "name": CRITERION, "operation": "like",
                           "input": "{{sample.output_text}}", "reference": "{{item.expected}}"}])
    content = [{"item": {"question": q, "expected": "at"}} for q in sentences(ITEMS, 77)]
    evaluation = {
        "evals": [{"eval_id": ev.id,
                   "input_messages": {"type": "template", "template": [
                       {"role": "user", "content": "{{item.question}}"}]},
                   "sampling_params": {"temperature": 0, "max_completion_tokens": 8,
                                       "seed": 1},
                   "source": {"type": "file_content", "content": content}}],
        "select_best": {"eval_id": ev.id, "criterion": CRITERION}}
    rows = [{"messages": [{"role": "user", "content": s},
                          {"role": "assistant", "content": TAUGHT}]} for s in sentences(16)]
    with open(write_jsonl(tmp_path_factory.mktemp("judged") / "t.jsonl", rows), "rb") as f:
        file = client.files.create(file=f, purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=file.id, suffix="judged",
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 3, "batch_size": 2}}},
        extra_body={"evaluation": evaluation})
    done = wait_until(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status in (
        "succeeded", "failed", "cancelled") and j, timeout=900, what="the job", every=1)
    assert done.status == "succeeded", done.error
    return Judged(client, serving_stack, ev.id,
                  FineTuningJob.model_validate(done.to_dict(), strict=True), content)


def test_the_base_each_checkpoint_and_the_final_model_are_scored_by_the_jobs_runs(
        judged: Judged) -> None:
    checkpoints = sorted(judged.client.fine_tuning.jobs.checkpoints.list(judged.job.id),
                         key=lambda c: c.step_number)
    assert len(checkpoints) == 3
    final = judged.native(f"/jobs/{judged.job.id}")["evaluation"]["scores"][-1]["model"]
    runs = [RunListResponse.model_validate(r.to_dict(), strict=True)
            for r in judged.client.evals.runs.list(judged.eval_id, limit=100)]
    mine = [r for r in runs if (r.metadata or {}).get("ftune_job_id") == judged.job.id]
    assert [r.model for r in mine] == [
        BASE, *(c.fine_tuned_model_checkpoint for c in checkpoints), final]
    assert [(r.metadata or {}).get("stage") for r in mine] == [
        "base", "checkpoints", "checkpoints", "checkpoints", "final"]
    for r in mine:
        assert r.status == "completed", r.error
        assert (r.result_counts.total, r.result_counts.errored) == (ITEMS, 0), r.model


def test_the_scores_are_on_the_job_and_in_its_events(judged: Judged) -> None:
    evaluation = judged.native(f"/jobs/{judged.job.id}")["evaluation"]
    assert evaluation["status"] == "completed" and evaluation["error"] is None
    scores = evaluation["scores"]
    assert [s["stage"] for s in scores] == ["base", *["checkpoints"] * 3, "final"]
    rates = [s["criteria"][CRITERION]["pass_rate"] for s in scores]
    assert rates[-1] > rates[0], rates  # the taught model says it; its base does not
    # Each checkpoint's scores beside its loss (GET /checkpoints), by the trackers' names.
    checkpoints = judged.native(f"/jobs/{judged.job.id}/checkpoints")["data"]
    assert [c["metrics"][f"evals/{judged.eval_id}/{CRITERION}/pass_rate"]
            for c in sorted(checkpoints, key=lambda c: c["step"])] == rates[1:-1]
    events = [e for e in judged.native(f"/jobs/{judged.job.id}/events?limit=500")["data"]
              if e["type"] == "evaluation"]
    assert len(events) == len(scores) + 1  # one per model, then the choice
    assert events[-1]["message"].startswith(f"best by {CRITERION} pass_rate")


def test_select_best_makes_the_best_checkpoint_the_result(judged: Judged) -> None:
    best = judged.native(f"/jobs/{judged.job.id}")["evaluation"]["best"]
    assert best["step"] is not None and ":ckpt-step-" in best["model"]
    assert judged.job.fine_tuned_model == best["model"]
    out = judged.client.chat.completions.create(
        model=best["model"], max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "say it"}])
    assert out.model == best["model"]


def test_sdk_runs_generate_through_the_deployments(judged: Judged) -> None:
    final = judged.native(f"/jobs/{judged.job.id}")["evaluation"]["scores"][-1]["model"]
    assert judged.job.fine_tuned_model is not None
    models = [BASE, final, judged.job.fine_tuned_model]  # catalog id, ft: name, checkpoint
    runs = [judged.client.evals.runs.create(judged.eval_id, name=m, data_source={
        "type": "completions", "model": m,
        "input_messages": {"type": "template", "template": [
            {"role": "user", "content": "{{item.question}}"}]},
        "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "seed": 1},
        "source": {"type": "file_content", "content": judged.content}}).id for m in models]
    for model, run_id in zip(models, runs, strict=True):
        done = finished_run(judged.client, judged.eval_id, run_id)
        assert done.status == "completed", done.error
        assert (done.model, done.result_counts.total, done.result_counts.errored) == (
            model, ITEMS, 0)
        assert [u.invocation_count for u in done.per_model_usage] == [ITEMS]
