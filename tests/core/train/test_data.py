"""Tokenization per format: which tokens carry a loss, truncation, splits, padding."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from core.errors import ErrorCode
from core.spec import JobSpec, parse_job_spec
from core.train.data import (
    IGNORE_INDEX,
    PadCollator,
    build_datasets,
    split_for_eval,
    tokenize_rows,
)
from core.train.failures import TrainFailure
from tests.utils.savedisk import save_to_disk
from tests.utils.tiny import CHAT_TEMPLATE, write_jsonl


def _spec(task: str = "causal_lm", **dataset: Any) -> JobSpec:
    return parse_job_spec(
        {
            "model": {"name_or_path": "/m", "task": task},
            "dataset": {"path": "/d.jsonl", "max_seq_length": 64, **dataset},
        }
    )


@pytest.fixture(scope="module")
def tok(tiny_causal_lm: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_causal_lm)


def test_prompt_completion_masks_the_prompt_and_appends_eos(tok: Any) -> None:
    spec = _spec(format="prompt_completion")
    ds = tokenize_rows(spec, tok, [{"prompt": "the cat sees", "completion": " a dog"}])
    ex = ds[0]
    prompt_len = len(tok("the cat sees")["input_ids"])
    completion = tok(" a dog", add_special_tokens=False)["input_ids"]
    assert ex["labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert ex["labels"][prompt_len:] == completion + [tok.eos_token_id]
    assert ex["input_ids"][prompt_len:] == completion + [tok.eos_token_id]
    assert ds.stats.loss_tokens == len(completion) + 1


def test_text_learns_every_token(tok: Any) -> None:
    ds = tokenize_rows(_spec(format="text"), tok, [{"text": "the big red dog runs"}])
    assert ds[0]["labels"] == ds[0]["input_ids"]
    assert ds[0]["input_ids"][-1] == tok.eos_token_id


def test_chat_loss_only_on_assistant_turns_with_generation_markers(tok: Any) -> None:
    msgs = [
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "content": "no"},
    ]
    ds = tokenize_rows(_spec(format="chat"), tok, [{"messages": msgs}])
    ex = ds[0]
    learned = [t for t, l in zip(ex["input_ids"], ex["labels"]) if l != IGNORE_INDEX]
    # The template wraps "<|assistant|>content</s>" in {% generation %}.
    assert tok.decode(learned) == "<|assistant|>yes</s><|assistant|>no</s>"


def test_chat_without_generation_markers_masks_per_turn(tok: Any) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tok.name_or_path)
    plain.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "content": "no"},
    ]
    ex = tokenize_rows(_spec(format="chat"), plain, [{"messages": msgs}])[0]
    learned = [t for t, l in zip(ex["input_ids"], ex["labels"]) if l != IGNORE_INDEX]
    # The assistant header is the generation prompt: given to the model, not learned.
    assert plain.decode(learned) == "yes</s>no</s>"


def test_truncation_is_counted_and_cut_at_max_seq_length(tok: Any) -> None:
    long = " ".join(["the big red dog runs"] * 30)
    spec = _spec(format="text", max_seq_length=16)
    ds = tokenize_rows(spec, tok, [{"text": long}, {"text": "a cat"}])
    assert ds.stats.truncated == 1
    assert len(ds[0]["input_ids"]) == 16
    assert ds.stats.tokens == 16 + len(ds[1]["input_ids"])


def test_prompt_longer_than_max_seq_length_is_dropped(tok: Any) -> None:
    long = " ".join(["the big red dog runs"] * 30)
    spec = _spec(format="prompt_completion", max_seq_length=16)
    ds = tokenize_rows(
        spec, tok, [{"prompt": long, "completion": " yes"}, {"prompt": "a", "completion": " b"}]
    )
    assert (ds.stats.dropped, ds.stats.examples) == (1, 1)
    assert ds.stats.dropped_rows == [1]


def test_all_rows_dropped_is_invalid_dataset(tok: Any, tmp_path: Path) -> None:
    long = " ".join(["the big red dog runs"] * 30)
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": long, "completion": " yes"}] * 3)
    spec = _spec(format="prompt_completion", max_seq_length=16)
    with pytest.raises(TrainFailure) as info:
        build_datasets(spec, data, None, tok)
    assert info.value.code == ErrorCode.invalid_dataset
    assert "max_seq_length" in info.value.message


def test_missing_field_is_invalid_dataset_naming_row_and_field(tok: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "ok"}, {"txt": "typo"}])
    with pytest.raises(TrainFailure) as info:
        build_datasets(_spec(format="text"), data, None, tok)
    assert info.value.code == ErrorCode.invalid_dataset
    assert "row 2, field 'text': missing" in info.value.message


def test_eval_split_is_deterministic_and_disjoint() -> None:
    a = split_for_eval(100, 0.2, seed=3)
    assert a == split_for_eval(100, 0.2, seed=3)
    train, ev = a
    assert len(ev) == 20 and not set(train) & set(ev)
    assert split_for_eval(100, 0.2, seed=4) != a


def test_classification_labels_sorted_to_ids(tok: Any, tmp_path: Path) -> None:
    rows = [
        {"text": "a", "label": "pos"},
        {"text": "b", "label": "neg"},
        {"text": "c", "label": "mid"},
    ]
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    out = build_datasets(_spec("seq_cls", format="classification"), data, None, tok)
    assert out.labels == ["mid", "neg", "pos"]
    assert [ex["labels"] for ex in out.train.examples] == [2, 1, 0]


def test_integer_labels_keep_their_value_as_id(tok: Any, tmp_path: Path) -> None:
    rows = [{"text": t, "label": n} for t, n in zip("abcd", [10, 2, 0, 1])]
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    out = build_datasets(_spec("seq_cls", format="classification"), data, None, tok)
    assert out.labels == ["0", "1", "2", "10"]


def test_collator_pads_right_with_masked_labels() -> None:
    batch = PadCollator(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [-100]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [-100, -100, -100]]


def test_json_array_reads_like_jsonl(tok: Any, tmp_path: Path) -> None:
    rows = [{"prompt": "the cat sees", "completion": f" a dog {i}"} for i in range(3)]
    lines = write_jsonl(tmp_path / "t.jsonl", rows)
    array = tmp_path / "t.json.gz"
    array.write_bytes(gzip.compress(json.dumps(rows).encode()))
    spec = _spec(format="prompt_completion")
    a, b = build_datasets(spec, lines, None, tok), build_datasets(spec, array, None, tok)
    assert a.train.examples == b.train.examples and a.train.stats.rows == 3


def test_json_array_bad_element_is_invalid_dataset_naming_the_row(tok: Any, tmp_path: Path) -> None:
    data = tmp_path / "t.json"
    data.write_text(json.dumps([{"text": "ok"}, {"text": "fine"}, {"txt": "typo"}]))
    with pytest.raises(TrainFailure) as info:
        build_datasets(_spec(format="text"), data, None, tok)
    assert info.value.code == ErrorCode.invalid_dataset
    assert "row 3, field 'text': missing" in info.value.message


def test_saved_dataset_directory_is_read(tok: Any, tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": "the cat"},
                {"role": "assistant", "content": "yes"},
            ]
        }
        for _ in range(5)
    ]
    data = save_to_disk(tmp_path / "saved", rows, shards=2)
    out = build_datasets(_spec(format="chat"), data, None, tok)
    assert (out.train.stats.rows, len(out.train)) == (5, 5)


def test_gzip_data_past_the_operators_limit_is_invalid_dataset(tok: Any, tmp_path: Path) -> None:
    """The worker passes settings.max_decompressed_bytes (runtime.max_decompressed_bytes):
    the trainer holds compressed data to the same bound the API checked at upload."""
    data = tmp_path / "t.jsonl.gz"
    data.write_bytes(gzip.compress(b"".join(b'{"text": "the cat"}\n' for _ in range(200))))
    with pytest.raises(TrainFailure) as info:
        build_datasets(_spec(format="text"), data, None, tok, max_decompressed_bytes=1000)
    assert info.value.code == ErrorCode.invalid_dataset
    assert "limit of 1000 decompressed bytes" in info.value.message
