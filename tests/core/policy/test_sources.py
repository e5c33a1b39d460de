"""core.policy.sources: where a job's model and data may come from, and remote code."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from core.infra.settings import Settings
from core.policy import (
    Refused,
    chat_template_refusal,
    context_length_refusal,
    data_path,
    model_kind,
    model_location,
    remote_code_refusal,
    stored_upload,
)
from core.spec import ModelSpec


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    out = {name: tmp_path / name for name in ("models", "data", "elsewhere", "home")}
    for p in out.values():
        p.mkdir()
    return out


def settings(roots: dict[str, Path], **kw: Any) -> Settings:
    return Settings(
        data_dir=roots["home"],
        allowed_model_roots=[roots["models"]],
        allowed_data_roots=[roots["data"]],
        **kw,
    )


@pytest.mark.parametrize(
    ("name", "kind"),
    [("/m", "path"), ("~/m", "path"), ("org/m", "hub"), ("m", "hub"), ("./m", "other"),
     ("a/b/c", "other")],
)
def test_model_kind(name: str, kind: str) -> None:
    assert model_kind(name) == kind


def test_a_model_directory_under_a_root_is_resolved(roots: dict[str, Path]) -> None:
    (roots["models"] / "m").mkdir()
    assert model_location(str(roots["models"] / "m"), settings(roots)) == str(roots["models"] / "m")


def test_a_model_directory_outside_the_roots_is_refused(roots: dict[str, Path]) -> None:
    with pytest.raises(Refused, match="outside the allowed roots") as e:
        model_location(str(roots["elsewhere"]), settings(roots))
    assert (e.value.code, e.value.param) == ("model_not_found", "model.name_or_path")


def test_a_model_path_must_be_a_directory(roots: dict[str, Path]) -> None:
    (roots["models"] / "file").write_text("x")
    with pytest.raises(Refused) as e:
        model_location(str(roots["models"] / "file"), settings(roots))
    assert str(e.value) == "model.name_or_path: not a directory"


def test_the_api_also_wants_a_config_json(roots: dict[str, Path]) -> None:
    (roots["models"] / "m").mkdir()
    s = settings(roots)
    assert model_location(str(roots["models"] / "m"), s)  # the worker does not ask for one
    with pytest.raises(Refused, match="no config.json in the model directory"):
        model_location(str(roots["models"] / "m"), s, need_config=True)


def test_hub_ids_follow_the_operator_switch(roots: dict[str, Path]) -> None:
    assert model_location("org/m", settings(roots)) == "org/m"
    with pytest.raises(Refused, match="hub models are disabled on this server"):
        model_location("org/m", settings(roots, allow_hub_models=False))


def test_a_name_that_is_neither_path_nor_hub_id_is_refused(roots: dict[str, Path]) -> None:
    with pytest.raises(Refused, match="must be a hub id"):
        model_location("../m", settings(roots))


def test_remote_code_needs_the_operator() -> None:
    model = ModelSpec(name_or_path="org/m", trust_remote_code=True)
    refusal = remote_code_refusal(model, allowed=False)
    assert refusal is not None and refusal.code == "invalid_spec"
    assert str(refusal) == "model.trust_remote_code: not allowed on this server"
    assert remote_code_refusal(model, allowed=True) is None
    assert remote_code_refusal(ModelSpec(name_or_path="org/m"), allowed=False) is None


def test_data_paths_are_confined_to_the_data_roots(roots: dict[str, Path]) -> None:
    (roots["data"] / "d.jsonl").write_text("{}\n")
    assert data_path(str(roots["data"] / "d.jsonl"), settings(roots), "dataset.path") == (
        roots["data"] / "d.jsonl"
    )
    (roots["elsewhere"] / "d.jsonl").write_text("{}\n")
    with pytest.raises(Refused) as e:
        data_path(str(roots["elsewhere"] / "d.jsonl"), settings(roots), "dataset.eval_path")
    assert (e.value.code, e.value.param) == ("invalid_dataset", "dataset.eval_path")


def test_an_upload_is_found_relative_to_the_uploads_dir(roots: dict[str, Path]) -> None:
    s = settings(roots)
    s.uploads_dir.mkdir(parents=True)
    (s.uploads_dir / "f.jsonl").write_bytes(b"abc")
    assert stored_upload("file-1", "f.jsonl", s, "dataset.file_id") == s.uploads_dir / "f.jsonl"


def test_a_missing_upload_is_refused(roots: dict[str, Path]) -> None:
    with pytest.raises(Refused) as e:
        stored_upload("file-1", str(roots["home"] / "gone"), settings(roots), "dataset.file_id")
    assert str(e.value) == "dataset.file_id: file file-1 is missing from storage"


def test_an_upload_changed_since_validation_is_refused(roots: dict[str, Path]) -> None:
    path = roots["home"] / "f.jsonl"
    path.write_bytes(b"abc")
    sha = hashlib.sha256(b"abc").hexdigest()
    s = settings(roots)
    assert stored_upload("file-1", str(path), s, "p", size=3, sha256=sha) == path
    path.write_bytes(b"abd")
    with pytest.raises(Refused, match="changed in storage since it was uploaded"):
        stored_upload("file-1", str(path), s, "p", size=3, sha256=sha)


def test_chat_template_is_found_in_the_tokenizer_files(tmp_path: Path) -> None:
    none, in_config, jinja, as_json = (tmp_path / n for n in ("none", "config", "jinja", "json"))
    for d in (none, in_config, jinja, as_json):
        d.mkdir()
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (in_config / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    (jinja / "chat_template.jinja").write_text("{{ x }}")
    (as_json / "chat_template.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    refusal = chat_template_refusal(none)
    assert refusal is not None and refusal.param == "dataset.format"
    assert "no chat_template in tokenizer_config.json" in refusal.message
    assert [chat_template_refusal(d) for d in (in_config, jinja, as_json)] == [None] * 3


def test_chat_template_of_a_model_without_tokenizer_files(tmp_path: Path) -> None:
    assert chat_template_refusal(tmp_path) is not None
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert chat_template_refusal(tmp_path) is None  # unreadable: the trainer says why


def test_a_refused_model_path_names_the_setting_that_would_allow_it(roots: dict[str, Path]) -> None:
    (roots["elsewhere"] / "m").mkdir()
    none = Settings(data_dir=roots["home"])
    with pytest.raises(Refused) as e:
        model_location(str(roots["elsewhere"] / "m"), none)
    assert e.value.message == (
        "no model roots are configured on this server, so model paths are refused: the "
        "operator sets FTUNE_ALLOWED_MODEL_ROOTS (colon-separated directories) and restarts "
        "the server")
    with pytest.raises(Refused) as e:
        model_location(str(roots["elsewhere"] / "m"), settings(roots))
    assert e.value.message.endswith(
        f"outside the allowed roots (FTUNE_ALLOWED_MODEL_ROOTS: {roots['models']})")
    with pytest.raises(Refused, match="FTUNE_ALLOWED_DATA_ROOTS"):
        data_path(str(roots["elsewhere"]), none, "dataset.path")


@pytest.mark.parametrize(
    ("config", "allowed"),
    [({"max_position_embeddings": 512}, 512),  # a learned table: its length
     ({"n_positions": 1024}, 1024),  # GPT-2 style
     ({"text_config": {"max_position_embeddings": 512}}, 512),  # a multimodal config
     ({"max_position_embeddings": 512, "rope_parameters": {"rope_theta": 1e4}}, 2048),
     ({"max_position_embeddings": 512, "rope_theta": 1e4,
       "rope_scaling": {"type": "linear", "factor": 8}}, None),  # stretched on purpose
     ({"d_model": 64}, None)],  # T5: relative positions, no fixed length
)
def test_max_seq_length_beyond_the_models_positions_is_refused(
    tmp_path: Path, config: dict[str, Any], allowed: int | None
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    refusal = context_length_refusal(tmp_path, 100_000)
    assert (refusal is not None) == (allowed is not None)
    if refusal is not None:
        assert refusal.param == "dataset.max_seq_length"
        assert refusal.message.startswith("100000 is more than the model allows: ")
        assert refusal.message.endswith(f"use at most {allowed}")
        assert context_length_refusal(tmp_path, allowed) is None
        assert context_length_refusal(tmp_path, allowed + 1) is not None
