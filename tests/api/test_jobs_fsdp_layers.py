"""POST /v1/jobs checks FSDP's layer classes against a local model at submit time (the model
is built from its config.json on the meta device: no weights needed or read)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows
from tests.utils.tiny import tiny_llama_config


@pytest.fixture(scope="module")
def llama_dir(api: Api) -> Path:
    path = api.settings.allowed_model_roots[0] / "llama-config-only"
    tiny_llama_config().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(api: Api) -> str:
    return upload_rows(api.client(api.key_a), TEXT_ROWS)


def fsdp_body(text_file: str, model: Path | str, **fsdp: object) -> dict:
    return job_body(
        text_file,
        model={"name_or_path": str(model)},
        distributed={"strategy": "fsdp", "num_processes": 2, "fsdp": fsdp},
    )


def test_unknown_layer_class_is_422_on_its_param(
    client_a: httpx.Client, text_file: str, llama_dir: Path
) -> None:
    r = client_a.post(
        "/v1/jobs",
        json=fsdp_body(text_file, llama_dir, transformer_layer_cls_to_wrap=["GPT2Block"]),
    )
    assert r.status_code == 422, r.text
    details = r.json()["error"]["details"]
    (detail,) = [
        d for d in details if d["param"] == "distributed.fsdp.transformer_layer_cls_to_wrap"
    ]
    assert "GPT2Block not found in LlamaForCausalLM" in detail["message"]
    assert "LlamaDecoderLayer" in detail["message"]  # the candidates


def test_layer_classes_of_the_model_are_accepted(
    client_a: httpx.Client, text_file: str, llama_dir: Path
) -> None:
    named = fsdp_body(text_file, llama_dir, transformer_layer_cls_to_wrap=["LlamaDecoderLayer"])
    assert client_a.post("/v1/jobs", json=named).status_code == 201
    default = fsdp_body(text_file, llama_dir)  # the model's _no_split_modules
    assert client_a.post("/v1/jobs", json=default).status_code == 201


def test_a_model_config_that_cannot_be_read_is_422(
    api: Api, client_a: httpx.Client, text_file: str
) -> None:
    # tests/api/conftest.py's "tiny" model has a config.json of "{}": no model_type.
    r = client_a.post(
        "/v1/jobs", json=fsdp_body(text_file, api.settings.allowed_model_roots[0] / "tiny")
    )
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "distributed.fsdp.transformer_layer_cls_to_wrap"
    assert "cannot read the model config" in r.json()["error"]["message"]


def test_size_based_wrap_and_hub_models_are_not_checked_here(
    client_a: httpx.Client, text_file: str, llama_dir: Path
) -> None:
    size = fsdp_body(text_file, llama_dir, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000)
    assert client_a.post("/v1/jobs", json=size).status_code == 201
    # Hub ids are resolved (and checked) by the worker: the API downloads nothing.
    hub = fsdp_body(text_file, "org/tiny-model", transformer_layer_cls_to_wrap=["Anything"])
    assert client_a.post("/v1/jobs", json=hub).status_code == 201


def test_fsdp2_on_a_model_with_weights_tied_beyond_the_embeddings_is_422(
    client_a: httpx.Client, text_file: str, api: Api
) -> None:
    """T5 ties one embedding across four modules; accelerate's FSDP2 wrapping would fail at
    the first step. Refused at submit, naming the field and what to use instead."""
    from transformers import T5Config

    path = api.settings.allowed_model_roots[0] / "t5-config-only"
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=128).save_pretrained(path)
    body = fsdp_body(text_file, path, version=2)
    body["model"]["task"] = "seq2seq_lm"
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(4)]
    body["dataset"] = {"file_id": upload_rows(client_a, rows), "format": "prompt_completion"}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    details = r.json()["error"]["details"]
    (detail,) = [d for d in details if d["param"] == "distributed.fsdp.version"]
    assert "FSDP2 cannot wrap T5ForConditionalGeneration" in detail["message"]
    assert "shared" in detail["message"] and "ddp or deepspeed" in detail["message"]
