"""Bad input is refused at create, naming the field (and the row): through the official SDK,
which raises BadRequestError with OpenAI's ``param``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from api.services.keys import authenticate
from tests.api.evals.conftest import EXACT, QA_SCHEMA, qa_eval, write
from tests.utils.api import Api
from tests.utils.served_jobs import served_job


def refused(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value


def param(e: openai.BadRequestError) -> str:
    return str(e.body["param"])  # type: ignore[index]


def completions(model: str = "tiny", content: str = "{{item.question}}",
                source: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "completions", "model": model,
            "input_messages": {"type": "template",
                               "template": [{"role": "user", "content": content}]},
            "source": source or {"type": "file_content",
                                 "content": [{"item": {"question": "q", "answer": "a"}}]}}


def test_a_grader_naming_a_field_the_schema_lacks(sdk: openai.OpenAI) -> None:
    e = refused(lambda: qa_eval(sdk, {**EXACT, "reference": "{{item.answr}}"}))
    assert param(e) == "testing_criteria[0].reference"
    assert "has no field 'answr'" in str(e) and "answer, question" in str(e)


def test_a_label_model_naming_a_field_the_schema_lacks(sdk: openai.OpenAI) -> None:
    label = {"type": "label_model", "name": "tone", "model": "judge", "labels": ["ok", "bad"],
             "passing_labels": ["ok"], "input": [{"role": "user", "content": "{{item.tone}}"}]}
    e = refused(lambda: qa_eval(sdk, label))
    details = {d["param"] for d in e.body["details"]}  # type: ignore[index]
    # And the server has no judge configured: said on the same criterion.
    assert details == {"testing_criteria[0].input[0].content", "testing_criteria[0].type"}


def test_two_criteria_with_one_name(sdk: openai.OpenAI) -> None:
    e = refused(lambda: qa_eval(sdk, EXACT, {**EXACT, "operation": "ilike"}))
    assert param(e) == "testing_criteria[1].name"


def test_an_item_schema_that_is_not_an_object(sdk: openai.OpenAI) -> None:
    e = refused(lambda: qa_eval(sdk, schema={"type": "array"}))
    assert param(e) == "data_source_config.item_schema.type"


def test_a_sample_reference_without_a_sample_schema(sdk: openai.OpenAI) -> None:
    e = refused(lambda: sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": QA_SCHEMA},
        testing_criteria=[EXACT]))  # type: ignore[list-item]
    assert param(e) == "testing_criteria[0].input"
    assert "include_sample_schema" in str(e)


def test_the_logs_data_source_config_is_not_served(sdk: openai.OpenAI) -> None:
    e = refused(lambda: sdk.evals.create(data_source_config={"type": "logs"},
                                         testing_criteria=[EXACT]))  # type: ignore[list-item]
    assert param(e) == "data_source_config.type"


def test_an_input_template_naming_a_field_the_schema_lacks(sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source=completions(  # type: ignore[arg-type]
        content="Q: {{item.query}}")))
    assert param(e) == "data_source.input_messages.template[0].content"


def test_rows_of_the_run_that_do_not_match_the_item_schema(sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    rows = [{"item": {"question": "q", "answer": "a"}, "sample": {"output_text": "a"}},
            {"item": {"question": "q"}, "sample": {"output_text": "a"}},
            {"item": {"question": 3, "answer": "a"}, "sample": {"output_text": "a"}}]
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source={
        "type": "jsonl", "source": {"type": "file_content", "content": rows}}))
    details = [(d["param"], d["message"]) for d in e.body["details"]]  # type: ignore[index]
    assert details == [("data_source.source.content[1]", "item: 'answer' is a required property"),
                       ("data_source.source.content[2]", ("item.question: 3 is not of type "
                        "'string'"))]


def test_rows_of_an_item_file_that_do_not_match_name_their_row(sdk: openai.OpenAI,
                                                               tmp_path: Path) -> None:
    ev = qa_eval(sdk)
    text = ('{"item": {"question": "q", "answer": "a"}, "sample": {"output_text": "a"}}\n'
            '{"item": {"question": "q", "answer": "a"}}\n')
    with open(write(tmp_path / "items.jsonl", text), "rb") as f:
        file = sdk.files.create(file=f, purpose="evals")  # type: ignore[arg-type]
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source={
        "type": "jsonl", "source": {"type": "file_id", "id": file.id}}))
    assert param(e) == "data_source.source.id"
    assert str(e.body["message"]).startswith("data_source.source.id: row 2: a jsonl run "  # type: ignore[index]
                                             "grades the given samples")


def test_an_item_file_with_rows_that_are_no_items_is_refused_at_upload(
        sdk: openai.OpenAI, tmp_path: Path) -> None:
    text = '{"item": {"a": 1}}\n{"question": "q"}\n{"item": {"a": 2}, "sample": "x"}\n'
    with open(write(tmp_path / "bad.jsonl", text), "rb") as f:
        e = refused(lambda: sdk.files.create(file=f, purpose="evals"))  # type: ignore[arg-type]
    assert param(e) == "file"
    messages = [d["message"] for d in e.body["details"]]  # type: ignore[index]
    assert [m.split(":")[0] for m in messages] == ["row 2", "row 3"]


def test_a_fine_tune_file_is_not_an_item_file(api: Api, sdk: openai.OpenAI,
                                              tmp_path: Path) -> None:
    ev = qa_eval(sdk)
    with open(write(tmp_path / "d.jsonl", '{"text": "hello"}\n'), "rb") as f:
        file = sdk.files.create(file=f, purpose="fine-tune")
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source={
        "type": "jsonl", "source": {"type": "file_id", "id": file.id}}))
    assert "purpose 'evals'" in str(e)


def test_an_unknown_model(sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source=completions(  # type: ignore[arg-type]
        model="gpt-9")))
    assert param(e) == "data_source.model"


def test_another_tenants_fine_tuned_model(api: Api, sdk: openai.OpenAI,
                                          sdk_b: openai.OpenAI, tmp_path: Path) -> None:
    with api.session() as s, s.begin():  # a job of tenant B's that succeeded
        tenant_b, _ = authenticate(s, api.key_b)
        served_job(s, tenant_b.id, tmp_path, name="mine")
    theirs = next(m.id for m in sdk_b.models.list() if m.id.startswith("ft:"))
    ev = qa_eval(sdk)
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source=completions(  # type: ignore[arg-type]
        model=theirs)))
    assert param(e) == "data_source.model"
    ev_b = qa_eval(sdk_b)  # its owner may run it
    assert sdk_b.evals.runs.create(ev_b.id, data_source=completions(  # type: ignore[arg-type]
        model=theirs)).model == theirs


def test_a_responses_data_source_is_not_served(sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source={  # type: ignore[arg-type]
        "type": "responses", "source": {"type": "responses"}}))
    assert param(e) == "data_source.type"
    assert "not served here" in str(e)


def test_sampling_parameters_without_meaning_here(sdk: openai.OpenAI) -> None:
    ev = qa_eval(sdk)
    ds = {**completions(), "sampling_params": {"reasoning_effort": "high", "temperature": 0}}
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source=ds))  # type: ignore[arg-type]
    assert param(e) == "data_source.sampling_params.reasoning_effort"


def test_a_checkpoints_model_name_is_accepted_and_an_unkept_step_refused(
        api: Api, sdk: openai.OpenAI, tmp_path: Path) -> None:
    with api.session() as s, s.begin():  # a job of this tenant's that kept step 5
        tenant, _ = authenticate(s, api.key_a)
        job_id = served_job(s, tenant.id, tmp_path, name="ckpt", steps=(5,)).id
    final = next(m.id for m in sdk.models.list() if job_id in m.id)
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, data_source=completions(  # type: ignore[arg-type]
        model=f"{final}:ckpt-step-5"))
    assert run.model == f"{final}:ckpt-step-5" and run.status == "queued"
    e = refused(lambda: sdk.evals.runs.create(ev.id, data_source=completions(  # type: ignore[arg-type]
        model=f"{final}:ckpt-step-6")))
    assert param(e) == "data_source.model"
