"""Tokenization per format: which tokens carry a loss, truncation, splits, padding."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from core.data.collator import PadCollator
from core.data.datasets import build_datasets, split_for_eval
from core.data.tokenize import IGNORE_INDEX, tokenize_rows
from core.infra.errors import ErrorCode, TrainFailure
from core.spec import JobSpec
from tests.utils.savedisk import save_to_disk
from tests.utils.specs import parsed_spec
from tests.utils.tiny import CHAT_TEMPLATE, write_jsonl


def _spec(task: str = "causal_lm", **dataset: Any) -> JobSpec:
    return parsed_spec("/m", task=task,
                       dataset={"path": "/d.jsonl", "max_seq_length": 64, **dataset})


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


LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize("template", ["chatml", "plain", "llama3"])
@pytest.mark.parametrize(
    "messages",
    [
        [("system", "be brief"), ("user", "the cat"), ("assistant", "yes", 1),
         ("user", "the dog"), ("assistant", "no", 1)],
        [("user", "the cat"), ("assistant", "yes", 0), ("user", "the dog"),
         ("assistant", "yes", 1)],
        # Text the template trims (llama3): not written verbatim, so rendered by prefixes.
        [("user", "the cat"), ("assistant", " yes \n", 1)],
        [("user", "the cat"), ("assistant", "the cat", 1), ("user", "the cat"),
         ("assistant", "the cat", 1)],
    ],
    ids=["system_two_turns", "weight_0_same_text", "trimmed", "repeated"],
)
def test_spans_found_in_one_rendering_are_those_of_prefix_rendering(
    tok: Any, template: str, messages: list[tuple[Any, ...]]
) -> None:
    from transformers import AutoTokenizer

    from core.data.chat_spans import _framed_spans, _prefix_spans, _render
    from core.data.formats import Chat
    from core.spec.chat_templates import CHATML

    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    t.chat_template = {
        "chatml": CHATML,
        "plain": CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
        "llama3": LLAMA3_LIKE,
    }[template]
    chat = Chat([{"role": m[0], "content": m[1]} for m in messages],
                [m[2] if len(m) > 2 else 0 for m in messages])
    text = _render(t, chat, len(chat.messages))
    framed = _framed_spans(t, chat, text)
    assert framed is not None or (template, messages[1][1]) == ("llama3", " yes \n")
    if framed is not None:
        assert framed == _prefix_spans(t, chat, text)


def test_token_spans_from_span_boundaries_are_those_of_the_offsets() -> None:
    """Byte-level tokens of one character share its offsets, and a span boundary may fall
    inside a token: the boundary lookup agrees with bisecting every offset."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from core.data.chat_spans import _boundary_spans, _token_spans

    bt = Tokenizer(models.BPE())
    bt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bt.train_from_iterator(
        ["the cat sees the dog", "été à la plage", "snow ☃ and 🐱 cats"] * 50,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            show_progress=False),
    )
    rng = random.Random(0)
    for text in ["the cat sees 🐱🐱 the dog", "été ☃ plage", "catsees  the  dog\n\nyes"]:
        enc = bt.encode(text, add_special_tokens=False)
        for _ in range(200):
            a = rng.randrange(len(text) + 1)
            b = rng.randrange(a, len(text) + 1)
            spans = [(a, b)]
            assert _boundary_spans(enc, len(enc.ids), len(text), spans) == _token_spans(
                enc.offsets, spans)
