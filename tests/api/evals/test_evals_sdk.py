"""client.evals.* and client.evals.runs.* of the official SDK against ftune: the objects
validate with the SDK's own types in strict mode, and a jsonl run of given answers, executed
by the worker's code, gives exact counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import EvalCreateResponse, EvalDeleteResponse, EvalRetrieveResponse
from openai.types.evals import RunCancelResponse, RunCreateResponse, RunRetrieveResponse
from openai.types.evals.runs import OutputItemListResponse, OutputItemRetrieveResponse

from tests.api.evals.conftest import EXACT, execute, qa_eval, write
from tests.utils.api import Api

ANSWERS = [("2+2", "4", "4"), ("3+3", "6", "6"), ("capital of France", "Paris", "Lyon"),
           ("5-1", "4", "4"), ("colour of the sky", "blue", "green")]


def jsonl_source() -> dict[str, Any]:
    return {"type": "file_content", "content": [
        {"item": {"question": q, "answer": a}, "sample": {"output_text": given}}
        for q, a, given in ANSWERS]}


def strict(model: type[Any], obj: Any) -> Any:
    return model.model_validate(obj.to_dict(), strict=True)


def test_an_eval_is_created_read_updated_listed_and_deleted(sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk, EXACT, {"type": "text_similarity", "name": "close",
                              "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
                              "evaluation_metric": "fuzzy_match", "pass_threshold": 0.8},
                 name="arith")
    strict(EvalCreateResponse, ev)
    assert ev.object == "eval" and ev.id.startswith("eval-")
    assert ev.data_source_config.schema_["properties"]["item"]["required"] == ["question",
                                                                                "answer"]
    assert [c.name for c in ev.testing_criteria] == ["exact", "close"]
    got = sdk.evals.retrieve(ev.id)
    strict(EvalRetrieveResponse, got)
    assert got.testing_criteria[1].pass_threshold == 0.8  # type: ignore[union-attr]
    updated = sdk.evals.update(ev.id, name="arithmetic", metadata={"team": "math"})
    assert (updated.name, updated.metadata) == ("arithmetic", {"team": "math"})
    assert ev.id in [e.id for e in sdk.evals.list(limit=100).data]
    with pytest.raises(openai.BadRequestError):
        sdk.evals.list(after="eval-nothing")
    deleted = sdk.evals.delete(ev.id)
    strict(EvalDeleteResponse, deleted)
    with pytest.raises(openai.NotFoundError):
        sdk.evals.retrieve(ev.id)


def test_a_jsonl_run_of_given_answers_gives_exact_counts(api: Api, sdk: openai.OpenAI,
                                                         queued: list[str]) -> None:
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, name="given", data_source={"type": "jsonl",
                                                                  "source": jsonl_source()})
    strict(RunCreateResponse, run)
    assert run.status == "queued" and queued[-1] == run.id
    assert execute(api, run.id) == "completed"
    done = sdk.evals.runs.retrieve(run.id, eval_id=ev.id)
    strict(RunRetrieveResponse, done)
    assert done.status == "completed"
    assert done.result_counts.model_dump() == {"total": 5, "passed": 3, "failed": 2,
                                               "errored": 0}
    (per,) = done.per_testing_criteria_results
    assert (per.testing_criteria, per.passed, per.failed) == ("exact", 3, 2)
    assert done.per_model_usage == []
    assert done.report_url.endswith(f"/ui#/evals/{ev.id}/runs/{run.id}")
    items = sdk.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=100)
    for it in items.data:
        strict(OutputItemListResponse, it)
    assert [(it.datasource_item_id, it.status) for it in items.data] == [
        (0, "pass"), (1, "pass"), (2, "fail"), (3, "pass"), (4, "fail")]
    failed = sdk.evals.runs.output_items.list(run.id, eval_id=ev.id, status="fail")
    assert [it.datasource_item["question"] for it in failed.data] == [
        "capital of France", "colour of the sky"]
    one = sdk.evals.runs.output_items.retrieve(items.data[2].id, eval_id=ev.id, run_id=run.id)
    strict(OutputItemRetrieveResponse, one)
    assert one.sample.output[0].content == "Lyon"
    assert one.results[0].model_dump(exclude_none=True) == {
        "name": "exact", "type": "string_check", "score": 0.0, "passed": False}


def test_output_items_page_in_the_data_sources_order(api: Api, sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": jsonl_source()})
    execute(api, run.id)
    seen = [it.datasource_item_id
            for it in sdk.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=2)]
    assert seen == [0, 1, 2, 3, 4]  # the SDK follows has_more / after across pages


def test_an_item_file_uploaded_for_evals_feeds_a_run(api: Api, sdk: openai.OpenAI,
                                                    tmp_path: Path) -> None:
    rows = "".join(f'{{"item": {{"question": "{q}", "answer": "{a}"}}, '
                   f'"sample": {{"output_text": "{g}"}}}}\n' for q, a, g in ANSWERS)
    with open(write(tmp_path / "items.jsonl", rows), "rb") as f:
        uploaded = sdk.files.create(file=f, purpose="evals")  # type: ignore[arg-type]
    assert uploaded.purpose == "evals"
    assert uploaded.id in [f.id for f in sdk.files.list(purpose="evals")]
    assert uploaded.id not in [f.id for f in sdk.files.list(purpose="fine-tune")]
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, data_source={
        "type": "jsonl", "source": {"type": "file_id", "id": uploaded.id}})
    assert execute(api, run.id) == "completed"
    counts = sdk.evals.runs.retrieve(run.id, eval_id=ev.id).result_counts
    assert (counts.passed, counts.failed) == (3, 2)


def test_a_grader_that_errors_on_an_item_counts_it_errored(api: Api,
                                                           sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": ["string", "null"]}}}
    ev = qa_eval(sdk, schema=schema)
    rows = [{"item": {"answer": "4"}, "sample": {"output_text": "4"}},
            {"item": {"answer": None}, "sample": {"output_text": "4"}},
            {"item": {"answer": "5"}, "sample": {"output_text": "4"}}]
    run = sdk.evals.runs.create(ev.id, data_source={
        "type": "jsonl", "source": {"type": "file_content", "content": rows}})
    execute(api, run.id)
    done = sdk.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert done.result_counts.model_dump() == {"total": 3, "passed": 1, "failed": 1,
                                               "errored": 1}
    errored = [it for it in sdk.evals.runs.output_items.list(run.id, eval_id=ev.id)
               if it.status == "error"]
    assert errored[0].datasource_item_id == 1
    assert "{{item.answer}}: the field is null" in errored[0].results[0].to_dict()["error"]


def test_a_python_grader_runs_in_the_sandbox(api: Api, sdk: openai.OpenAI) -> None:
    source = ("import os\n"
              "def grade(sample, item):\n"
              "    if item['answer'] == 'boom':\n"
              "        raise ValueError('no grade for boom')\n"
              "    # The sandbox has no network and sees none of the host's files.\n"
              "    assert not os.path.exists('/work') and not os.path.exists('/root')\n"
              "    return 1.0 if sample['output_text'].strip() == item['answer'] else 0.25\n")
    ev = qa_eval(sdk, {"type": "python", "name": "py", "source": source, "pass_threshold": 0.5})
    rows = [{"item": {"question": "q", "answer": a}, "sample": {"output_text": s}}
            for a, s in (("4", " 4 "), ("5", "4"), ("boom", "4"))]
    run = sdk.evals.runs.create(ev.id, data_source={
        "type": "jsonl", "source": {"type": "file_content", "content": rows}})
    execute(api, run.id)
    items = list(sdk.evals.runs.output_items.list(run.id, eval_id=ev.id))
    assert [(it.status, it.results[0].score) for it in items] == [
        ("pass", 1.0), ("fail", 0.25), ("error", 0.0)]
    assert "ValueError: no grade for boom" in items[2].results[0].to_dict()["error"]


def test_a_queued_run_is_canceled_at_once(api: Api, sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": jsonl_source()})
    canceled = sdk.evals.runs.cancel(run.id, eval_id=ev.id)
    strict(RunCancelResponse, canceled)
    assert canceled.status == "canceled"
    assert execute(api, run.id) == "skipped"  # a worker that gets the message later
    assert sdk.evals.runs.retrieve(run.id, eval_id=ev.id).result_counts.total == 0


def test_runs_are_listed_and_a_finished_one_deleted(api: Api, sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    first = sdk.evals.runs.create(ev.id, data_source={"type": "jsonl",
                                                      "source": jsonl_source()})
    second = sdk.evals.runs.create(ev.id, data_source={"type": "jsonl",
                                                       "source": jsonl_source()})
    assert [r.id for r in sdk.evals.runs.list(ev.id)] == [first.id, second.id]
    assert [r.id for r in sdk.evals.runs.list(ev.id, order="desc")] == [second.id, first.id]
    with pytest.raises(openai.ConflictError):
        sdk.evals.runs.delete(first.id, eval_id=ev.id)  # queued: cancel it first
    execute(api, first.id)
    assert sdk.evals.runs.delete(first.id, eval_id=ev.id).deleted is True
    assert [r.id for r in sdk.evals.runs.list(ev.id, status="queued")] == [second.id]


def test_another_tenants_eval_does_not_exist(sdk: openai.OpenAI, sdk_b: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    with pytest.raises(openai.NotFoundError):
        sdk_b.evals.retrieve(ev.id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": jsonl_source()})
    assert ev.id not in [e.id for e in sdk_b.evals.list()]


def test_finished_runs_are_in_the_tenants_usage(api: Api, sdk: openai.OpenAI,
                                                 sdk_b: openai.OpenAI) -> None:
    def today(key: str) -> dict[str, Any]:
        return dict(api.client(key).get("/v1/usage").json()["data"][-1])

    before, before_b = today(api.key_a)["eval_runs"], today(api.key_b)["eval_runs"]
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": jsonl_source()})
    execute(api, run.id)
    assert today(api.key_a)["eval_runs"] == before + 1
    assert today(api.key_b)["eval_runs"] == before_b
