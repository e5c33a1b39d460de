"""The job spec's evaluation section (core/evals/training.py): what a submit refuses, against
evals and files in the database, and a submit over HTTP naming the fields."""

from __future__ import annotations

from typing import Any

import openai

from api.services.keys import authenticate
from core.evals.training import evaluation_problems
from core.spec.evaluation import EvaluationSpec
from tests.api.evals.conftest import qa_eval
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


def problems(api: Api, key: str, section: dict[str, Any]) -> list[tuple[str, str]]:
    with api.session() as s:
        tenant, _ = authenticate(s, key)
        found = evaluation_problems(s, tenant.id, api.settings,
                                    EvaluationSpec.model_validate(section))
    return [(p.param, p.message) for p in found]


def on(eval_id: str, rows: list[dict[str, Any]], content: str = "{{item.question}}",
       **extra: Any) -> dict[str, Any]:
    return {"evals": [{"eval_id": eval_id,
                       "input_messages": {"type": "template",
                                          "template": [{"role": "user", "content": content}]},
                       "source": {"type": "file_content", "content": rows}}], **extra}


ROWS = [{"item": {"question": "2+2", "answer": "4"}}]


def test_a_runnable_evaluation_has_no_problem(api: Api, sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    best = {"eval_id": ev.id, "criterion": "exact"}
    assert problems(api, api.key_a, on(ev.id, ROWS, select_best=best)) == []


def test_another_tenants_eval_is_refused(api: Api, sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    assert problems(api, api.key_b, on(ev.id, ROWS)) == [
        ("evaluation.evals[0].eval_id", f"no eval {ev.id!r} of yours")]


def test_templates_and_rows_against_the_item_schema(api: Api, sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    rows = [*ROWS, {"item": {"question": "3+3"}}]
    found = problems(api, api.key_a, on(ev.id, rows, content="{{item.prompt}}"))
    assert [p for p, _ in found] == ["evaluation.evals[0].input_messages.template[0].content",
                                     "evaluation.evals[0].source.content[1]"]


def test_select_best_names_a_criterion_of_a_named_eval(api: Api, sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    found = problems(api, api.key_a, on(ev.id, ROWS, select_best={"eval_id": ev.id,
                                                                  "criterion": "exactly"}))
    assert found == [("evaluation.select_best.criterion",
                      f"eval {ev.id} has no criterion 'exactly' (it has exact)")]


def test_a_criterion_on_a_field_the_rows_lack_is_refused(api: Api, sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "required": ["question"],
              "properties": {"question": {"type": "string"}, "answer": {"type": "string"}}}
    ev = qa_eval(sdk, schema=schema)  # its criterion reads {{item.answer}}
    rows = [*ROWS, {"item": {"question": "3+3"}}]
    assert problems(api, api.key_a, on(ev.id, rows)) == [
        ("evaluation.evals[0].source.content[1]",
         "item has no field 'answer', which criterion 'exact' reads")]


def test_a_job_whose_evaluation_cannot_run_is_refused_at_submit(
        api: Api, sdk: openai.OpenAI) -> None:
    theirs = qa_eval(openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key_b,
                                   max_retries=0))
    client = api.client(api.key_a)
    body = job_body(upload_rows(client, TEXT_ROWS), evaluation=on(
        theirs.id, ROWS, select_best={"eval_id": theirs.id, "criterion": "exact"},
        on=["base", "final"]))
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    found = {p["param"]: p["message"] for p in r.json()["error"]["details"]}
    assert found["evaluation.evals[0].eval_id"] == f"no eval {theirs.id!r} of yours"
    assert "is no catalog model" in found["evaluation.on"]  # org/tiny-model: bases by id
    assert "add 'checkpoints'" in found["evaluation.select_best"]
