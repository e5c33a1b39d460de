"""Data as users already have it, through the API: upload, then submit with format auto
(the default) or a named format; the receipt on the job object and in the dry run, the
preview of what will be trained, and each refusal a person can act on."""

from __future__ import annotations

import copy
import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.infra.settings import Settings
from tests.utils import samples
from tests.utils.api import Api, upload_rows


@pytest.fixture(scope="module")
def api_settings(
    tmp_path_factory: pytest.TempPathFactory, db_url: str, tiny_causal_lm: Path
) -> Settings:
    root = tmp_path_factory.mktemp("ftune")
    (root / "data-root").mkdir()
    return Settings(
        data_dir=root / "data",
        DATABASE_URL=db_url,
        BROKER_URL="filesystem://",
        allowed_model_roots=[tiny_causal_lm.parent],
        allowed_data_roots=[root / "data-root"],
        bootstrap_api_key="ft_bootstrap_" + secrets.token_hex(8),
        jobs_per_minute_per_tenant=1000,
    )


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    # The server thread shares this process: import what rendering and the dry run's
    # memory estimate need once, here, not inside a request racing the client's timeout.
    import peft  # noqa: F401
    import transformers  # noqa: F401


def body(model: Path, file_id: str | None = None, **dataset: Any) -> dict[str, Any]:
    training: dict[str, Any] = dataset.pop("training", {})
    ds = {"max_seq_length": 512, **dataset}
    if file_id is not None:
        ds["file_id"] = file_id
    return {
        "model": {"name_or_path": str(model)},
        "dataset": ds,
        "training": {"max_steps": 2, "per_device_train_batch_size": 2, **training},
    }


def details(r: httpx.Response) -> list[dict[str, str]]:
    assert r.status_code == 422, r.text
    return list(r.json()["error"]["details"])


@pytest.mark.parametrize(
    ("rows", "training", "receipt"),
    [
        ([samples.OPENAI_TOOLS, samples.OPENAI_WEIGHTED], {},
         {"format": "chat", "layout": "openai_chat",
          "columns_used": {"messages": "messages", "tools": "tools"},
          "columns_ignored": ["parallel_tool_calls"]}),
        (samples.ALPACA, {},
         {"format": "alpaca", "layout": "alpaca",
          "columns_used": {"prompt": "instruction", "query": "input", "response": "output"},
          "columns_ignored": []}),
        ([samples.SHAREGPT_TOOLS, samples.SHAREGPT], {},
         {"format": "sharegpt", "layout": "sharegpt",
          "columns_used": {"messages": "conversations", "tools": "tools"},
          "columns_ignored": []}),
        ([samples.OPENAI_DPO] * 2, {"objective": "dpo"},
         {"format": "preference", "layout": "openai_dpo",
          "columns_used": {"input": "input", "chosen": "preferred_output",
                           "rejected": "non_preferred_output"},
          "columns_ignored": []}),
        ([samples.SHAREGPT_DPO] * 2, {"objective": "dpo"},
         {"format": "preference", "layout": "sharegpt_preference",
          "columns_used": {"messages": "conversations", "chosen": "chosen",
                           "rejected": "rejected"},
          "columns_ignored": []}),
        ([samples.KTO_MESSAGES, {**samples.KTO_MESSAGES, "label": False}], {"objective": "kto"},
         {"format": "kto", "layout": "kto_messages",
          "columns_used": {"messages": "messages", "kto_tag": "label"},
          "columns_ignored": []}),
    ],
    ids=["openai_chat", "alpaca", "sharegpt", "openai_dpo", "sharegpt_dpo", "kto_messages"],
)
def test_format_is_detected_and_the_job_says_what_it_read(
    client_a: httpx.Client, tiny_causal_lm: Path, rows: list[dict[str, Any]],
    training: dict[str, Any], receipt: dict[str, Any],
) -> None:
    # The tiny model's own template ignores tools: rows with tools render through chatml.
    template = {"chat_template": "chatml"} if any("tools" in r for r in rows) else {}
    r = client_a.post("/v1/jobs", json=body(tiny_causal_lm, upload_rows(client_a, rows),
                                            training=training, **template))
    assert r.status_code == 201, r.text
    want = {**receipt, "detected": True, "rows": len(rows)}
    assert r.json()["data"] == want
    assert client_a.get(f"/v1/jobs/{r.json()['id']}").json()["data"] == want


def test_no_format_fits_one_422_naming_columns_and_close_formats(
    client_a: httpx.Client, tiny_causal_lm: Path
) -> None:
    rows = [{"question": "Name a bird.", "answer": "A robin."}] * 30
    (only,) = details(client_a.post("/v1/jobs", json=body(tiny_causal_lm, upload_rows(client_a, rows))))
    assert only["param"] == "dataset.format"
    assert only["message"].startswith(
        "no data format matches the columns found (question, answer); formats tried: text "
        "(text), prompt_completion (prompt, completion), openai_chat (messages), alpaca "
        "(instruction, output), sharegpt (conversations). Rename the columns, map them with "
        "dataset.columns, or set dataset.format"
    )
    # Mapped as LLaMA-Factory's dataset_info.json would, the same file is alpaca.
    mapped = body(tiny_causal_lm, upload_rows(client_a, rows),
                  columns={"prompt": "question", "response": "answer"})
    r = client_a.post("/v1/jobs", json=mapped)
    assert r.status_code == 201, r.text
    assert r.json()["data"]["columns_used"] == {"prompt": "question", "response": "answer"}


def test_two_formats_fitting_is_422_naming_both(client_a: httpx.Client, tiny_causal_lm: Path) -> None:
    rows = [{"text": "a b", **samples.OPENAI_PARTS}]
    (only,) = details(client_a.post("/v1/jobs", json=body(tiny_causal_lm, upload_rows(client_a, rows))))
    assert "fit more than one format: text (text) and openai_chat (messages)" in only["message"]


def test_a_column_missing_from_every_row_is_one_problem(
    client_a: httpx.Client, tiny_causal_lm: Path
) -> None:
    rows = [{"instruction": "Name a bird.", "input": "", "ouput": "A robin."}] * 40
    got = details(client_a.post("/v1/jobs", json=body(
        tiny_causal_lm, upload_rows(client_a, rows), format="alpaca")))
    assert got == [{
        "param": "dataset.columns.response",
        "message": "no row has a column 'output' (did you mean 'ouput'?); the rows have "
        "instruction, input, ouput",
    }]


def test_row_problems_are_counted_across_the_whole_file(
    api: Api, client_a: httpx.Client, tiny_causal_lm: Path
) -> None:
    """A broken line does not end the check: every bad row after it is counted too."""
    lines = [json.dumps(samples.OPENAI_PARTS)] * 2 + ["{not json"]
    lines += [json.dumps({"messages": [{"role": "user", "content": "hi"}]})] * 30
    path = api.settings.allowed_data_roots[0] / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    got = details(client_a.post("/v1/jobs", json=body(tiny_causal_lm, path=str(path))))
    assert got[0] == {"param": "dataset.path", "message": "row 3: not valid JSON (Expecting "
                      "property name enclosed in double quotes)"}
    assert got[1] == {"param": "dataset.messages_field",
                      "message": "row 4: field 'messages': no assistant turn to learn"}
    assert len(got) == 21
    assert got[-1]["message"] == "11 more problems not listed (31 in all)"


def test_images_are_refused_at_submit(client_a: httpx.Client, tiny_causal_lm: Path) -> None:
    (only,) = details(client_a.post("/v1/jobs", json=body(
        tiny_causal_lm, upload_rows(client_a, [samples.OPENAI_IMAGE]))))
    assert only["param"] == "dataset.messages_field"
    assert "image_url part: images, audio and files are not supported" in only["message"]


def test_an_unknown_spec_field_suggests_the_closest(client_a: httpx.Client, tiny_causal_lm: Path) -> None:
    spec = body(tiny_causal_lm, "file-x")
    spec["dataset"]["formt"] = "chat"
    spec["training"]["learning_rat"] = 0.1
    got = {d["param"]: d["message"] for d in details(client_a.post("/v1/jobs", json=spec))}
    assert got["dataset.formt"] == "Extra inputs are not permitted; did you mean 'format'?"
    assert got["training.learning_rat"].endswith("did you mean 'learning_rate'?")


# Drops an assistant answer that holds "!" (as some templates drop what they do not expect).
DROPS_EXCLAIMED = (
    "{% for m in messages %}{% if m['role'] != 'assistant' or '!' not in m['content'] %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
)


def test_rows_left_without_loss_are_named_or_skipped(
    client_a: httpx.Client, tiny_causal_lm: Path
) -> None:
    loud = copy.deepcopy(samples.OPENAI_PARTS)
    loud["messages"][1]["content"] = "Four!"
    file_id = upload_rows(client_a, [samples.OPENAI_PARTS, loud, loud])
    spec = body(tiny_causal_lm, file_id, chat_template=DROPS_EXCLAIMED)
    (only,) = details(client_a.post("/v1/jobs", json=spec))
    assert only["param"] == "dataset.chat_template"
    assert only["message"].startswith("2 row(s) have no token to learn once rendered with the "
                                      "chat template (rows 2, 3)")
    spec["dataset"]["skip_rows_without_loss"] = True
    r = client_a.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    assert (r.json()["data"]["rows_skipped"], r.json()["data"]["skipped_rows"]) == (2, [2, 3])


def test_a_template_that_ignores_tools_is_422(client_a: httpx.Client, tiny_causal_lm: Path) -> None:
    spec = body(tiny_causal_lm, upload_rows(client_a, [samples.SHAREGPT, samples.SHAREGPT_TOOLS]))
    (only,) = details(client_a.post("/v1/jobs", json=spec))
    assert only == {
        "param": "dataset.chat_template",
        "message": "row 2: the chat template does not write the tools or tool calls of this "
        "row (convert_currency missing from the rendering): set dataset.chat_template to one "
        "that does (e.g. chatml)",
    }


def test_an_unknown_template_name_is_422(client_a: httpx.Client, tiny_causal_lm: Path) -> None:
    spec = body(tiny_causal_lm, "file-x", chat_template="chatmll")
    got = {d["param"]: d["message"] for d in details(client_a.post("/v1/jobs", json=spec))}
    assert "'chatmll' is neither a named template (chatml) nor Jinja text" in got[
        "dataset.chat_template"]


def test_dry_run_shows_the_tokens_that_carry_loss(
    client_a: httpx.Client, tiny_causal_lm: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    file_id = upload_rows(client_a, [samples.OPENAI_WEIGHTED, samples.OPENAI_PARTS])
    r = client_a.post("/v1/jobs", params={"dry_run": "true", "preview": 1},
                      json=body(tiny_causal_lm, file_id))
    assert r.status_code == 200, r.text
    est = r.json()
    assert est["data_format"]["layout"] == "openai_chat" and est["data_format"]["detected"]
    (row,) = est["preview"]
    last = samples.OPENAI_WEIGHTED["messages"][4]["content"]
    learned = [t["id"] for t in row["tokens"] if t["loss"]]
    # The weight-0 answer is context; the last answer is learned with its header and EOS.
    assert learned == tok(f"<|assistant|>{last}</s>", add_special_tokens=False)["input_ids"]
    assert row["loss_tokens"] == len(learned) and row["kept"] is True
    assert "".join(t["text"] for t in row["tokens"]).startswith("<|system|>")


def test_eval_data_in_another_format_is_422(client_a: httpx.Client, tiny_causal_lm: Path) -> None:
    spec = body(tiny_causal_lm, upload_rows(client_a, samples.ALPACA),
                eval_file_id=upload_rows(client_a, [samples.OPENAI_PARTS]))
    (only,) = details(client_a.post("/v1/jobs", json=spec))
    assert only == {"param": "dataset.eval_file_id", "message": "the eval data is chat, the "
                    "training data alpaca: give both in one format (or name it in dataset.format)"}
