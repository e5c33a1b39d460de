"""The job spec's evaluation section (core/evals/training.py): what a submit would refuse,
against evals and files in the database."""

from __future__ import annotations

from typing import Any

import openai

from api.services.keys import authenticate
from core.evals.training import EvaluationSpec, evaluation_problems
from tests.api.evals.conftest import qa_eval
from tests.utils.api import Api


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
