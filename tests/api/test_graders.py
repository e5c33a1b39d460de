"""/v1/graders/validate and /run over HTTP, the same at OpenAI's paths through the official
SDK (client.fine_tuning.alpha.graders), and a grpo job's grader and rows checked at submit."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.graders.sandbox import sandbox_refusal
from core.infra.settings import Settings
from core.spec.catalog import CatalogModel
from tests.utils.api import Api, job_body, upload_rows

EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "operation": "eq"}
MULTI = {"type": "multi", "name": "both", "calculate_output": "0.5 * exact + 0.5 * near",
         "graders": {"exact": EXACT,
                     "near": {**EXACT, "name": "near", "operation": "ilike"}}}
SANDBOX = sandbox_refusal() is None
PYTHON = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n"}


@pytest.fixture(scope="module")
def api_settings(tmp_path_factory: pytest.TempPathFactory, db_url: str) -> Settings:
    root = tmp_path_factory.mktemp("ftune")
    (root / "models" / "tiny").mkdir(parents=True)
    (root / "models" / "tiny" / "config.json").write_text("{}")
    return Settings(
        data_dir=root / "data",
        DATABASE_URL=db_url,
        BROKER_URL="filesystem://",
        allowed_model_roots=[root / "models"],
        bootstrap_api_key="ft_bootstrap_" + secrets.token_hex(8),
        jobs_per_minute_per_tenant=1000,
        python_graders=True,
        python_grader_wall_seconds=5,
        model_catalog={"tiny": CatalogModel(location=str(root / "models" / "tiny"))},
    )


def test_validate_names_every_problem_by_its_field(client_a: httpx.Client) -> None:
    bad = {**MULTI, "calculate_output": "exact + __import__('os')",
           "graders": {"exact": {**EXACT, "operation": "startswith"}}}
    r = client_a.post("/v1/graders/validate", json={"grader": bad})
    assert r.status_code == 422, r.text
    params = {d["param"] for d in r.json()["error"]["details"]}
    assert "grader.graders.exact.operation" in params

    bad = {**MULTI, "calculate_output": "exact + __import__('os')"}
    r = client_a.post("/v1/graders/validate", json={"grader": bad})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "grader.calculate_output"

    ok = client_a.post("/v1/graders/validate", json={"grader": MULTI})
    assert ok.status_code == 200 and ok.json()["item_fields"] == ["answer"]


def test_run_scores_a_sample_and_each_sub_grader(client_a: httpx.Client) -> None:
    r = client_a.post("/v1/graders/run", json={"grader": MULTI, "model_sample": "paris",
                                               "item": {"answer": "Paris"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["reward"] == 0.5
    assert body["sub_rewards"] == {"both.exact": 0.0, "both.near": 1.0, "both": 0.5}
    assert body["errors"] == {}


def test_a_missing_item_field_is_an_error_with_a_zero(client_a: httpx.Client) -> None:
    r = client_a.post("/v1/graders/run", json={"grader": EXACT, "model_sample": "x", "item": {}})
    assert r.status_code == 200
    assert r.json()["reward"] == 0.0
    assert r.json()["errors"] == {"exact": "{{item.answer}}: no field 'answer'"}


def test_graders_need_a_key(api: Api) -> None:
    r = api.client().post("/v1/graders/validate", json={"grader": EXACT})
    assert r.status_code == 401


@pytest.mark.skipif(not SANDBOX, reason=str(sandbox_refusal()))
def test_python_graders_run_sandboxed_not_in_the_api_process(
    api: Api, client_a: httpx.Client
) -> None:
    key_file = api.settings.data_dir / "api_key"
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text("secret")
    source = ("import os\ndef grade(sample, item):\n"
              f"    if os.path.exists({str(key_file)!r}):\n        return 1.0\n"
              "    return 0.25 if os.getpid() < 10 else 0.0\n")
    r = client_a.post("/v1/graders/run", json={
        "grader": {"type": "python", "name": "py", "source": source}, "model_sample": "x"})
    assert r.status_code == 200, r.text
    # Not the API's files (no key file), and its own PID namespace (a PID below 10).
    assert r.json()["reward"] == 0.25


def test_the_openai_sdk_runs_and_validates_graders(api: Api) -> None:
    from openai import OpenAI
    from openai.types.fine_tuning.alpha import GraderRunResponse, GraderValidateResponse

    client = OpenAI(base_url=f"{api.url}/v1", api_key=api.key_a, max_retries=0)
    run = client.fine_tuning.alpha.graders.run(
        grader=MULTI,  # type: ignore[arg-type]
        model_sample="Paris", item={"answer": "Paris"},
    )
    checked = GraderRunResponse.model_validate(run.model_dump(by_alias=True))
    assert checked.reward == 1.0 and checked.sub_rewards["both.exact"] == 1.0
    assert checked.metadata.name == "both" and checked.metadata.type == "multi"
    assert checked.metadata.errors.formula_parse_error is False

    valid = client.fine_tuning.alpha.graders.validate(grader=EXACT)  # type: ignore[arg-type]
    assert GraderValidateResponse.model_validate(valid.model_dump()).grader is not None

    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.fine_tuning.alpha.graders.validate(
            grader={**EXACT, "operation": "startswith"}  # type: ignore[arg-type]
        )
    assert e.value.status_code == 400


def grpo_body(file_id: str, grader: dict[str, Any]) -> dict[str, Any]:
    body = job_body(file_id, training={
        "objective": "grpo", "max_steps": 5, "per_device_train_batch_size": 8,
        "grpo": {"grader": grader, "num_generations": 4}})
    body["model"] = {"name_or_path": "tiny"}
    body["dataset"]["format"] = "chat"
    return body


def test_grpo_rows_are_checked_against_the_grader_at_submit(
    api: Api, client_a: httpx.Client, tmp_path: Path
) -> None:
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            {"messages": [{"role": "user", "content": "3+3?"}]},
            {"messages": [{"role": "assistant", "content": "6"}], "answer": "6"}]
    r = client_a.post("/v1/jobs", json=grpo_body(upload_rows(client_a, rows), EXACT))
    assert r.status_code == 422, r.text
    messages = [d["message"] for d in r.json()["error"]["details"]]
    assert any(m.startswith("row 2: field 'answer': missing") for m in messages), messages
    assert any(m.startswith("row 3: field 'messages': the last message is from assistant")
               for m in messages), messages

    good = [rows[0]] * 4
    r = client_a.post("/v1/jobs", json=grpo_body(upload_rows(client_a, good), EXACT))
    assert r.status_code == 201, r.text


def test_grpo_grader_problems_name_the_spec_field(client_a: httpx.Client) -> None:
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}] * 4
    judge = {"type": "score_model", "name": "j", "model": "m",
             "input": [{"role": "user", "content": "{{sample.output_text}}"}]}
    r = client_a.post("/v1/jobs", json=grpo_body(upload_rows(client_a, rows), judge))
    assert r.status_code == 422
    details = r.json()["error"]["details"]
    assert {"param": "training.grpo.grader.type",
            "message": "score_model graders need a judge endpoint, which this server does not "
                       "configure (FTUNE_GRADER_JUDGE_URL)"} in details


def test_ftune_grade_checks_and_grades_against_every_row(api: Api, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from cli.main import app

    grader = tmp_path / "grader.json"
    grader.write_text(json.dumps(EXACT))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"answer": "Paris"}\n{"answer": "Rome"}\n')
    runner = CliRunner()
    common = ["--url", api.url, "--api-key", api.key_a]
    checked = runner.invoke(app, ["grade", str(grader), *common])
    assert checked.exit_code == 0, checked.output
    assert '"item_fields"' in checked.output

    graded = runner.invoke(app, ["grade", str(grader), "--sample", "Paris",
                                 "--item", f"@{rows}", *common])
    assert graded.exit_code == 0, graded.output
    assert graded.output.count('"reward": 1.0') == 1 and graded.output.count('"reward": 0.0') == 1

    missing = runner.invoke(app, ["grade", str(grader), "--sample", "Paris", "--item", "{}",
                                  *common])
    assert missing.exit_code == 1 and "no field 'answer'" in missing.output

    grader.write_text(json.dumps({**EXACT, "operation": "startswith"}))
    bad = runner.invoke(app, ["grade", str(grader), *common])
    assert bad.exit_code == 1 and "grader.operation" in bad.output


@pytest.fixture
def no_bubblewrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's PATH has every tool the sandbox needs but bwrap, as on a host where the
    operator set FTUNE_PYTHON_GRADERS=true and `make sandbox` never ran."""
    for tool in ("prlimit", "setpriv"):
        (tmp_path / tool).symlink_to(f"/usr/bin/{tool}")
    monkeypatch.setenv("PATH", str(tmp_path))


def said_the_real_reason(message: str) -> bool:
    return ("FTUNE_PYTHON_GRADERS=true" in message and "cannot run" in message
            and "apt-get install bubblewrap" in message and " off " not in message)


@pytest.mark.usefixtures("no_bubblewrap")
def test_every_refusal_of_an_enabled_python_grader_names_the_missing_sandbox(
    api: Api, client_a: httpx.Client
) -> None:
    from openai import BadRequestError, OpenAI

    for path, body in (("/v1/graders/validate", {"grader": PYTHON}),
                       ("/v1/graders/run", {"grader": PYTHON, "model_sample": "x"})):
        r = client_a.post(path, json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "grader.type"
        assert said_the_real_reason(r.json()["error"]["message"]), r.text

    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}] * 4
    file_id = upload_rows(client_a, rows)
    for query in ("?dry_run=true", ""):
        r = client_a.post(f"/v1/jobs{query}", json=grpo_body(file_id, PYTHON))
        assert r.status_code == 422, r.text
        (detail,) = [d for d in r.json()["error"]["details"]
                     if d["param"] == "training.grpo.grader.type"]
        assert said_the_real_reason(detail["message"]), detail

    sdk = OpenAI(base_url=f"{api.url}/v1", api_key=api.key_a, max_retries=0)
    with pytest.raises(BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="tiny", training_file=file_id, method={
            "type": "reinforcement", "reinforcement": {"grader": PYTHON}})  # type: ignore[typeddict-item]
    assert e.value.param == "method.reinforcement.grader.type"
    assert said_the_real_reason(e.value.message), e.value.body
