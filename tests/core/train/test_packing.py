"""Packing: bins, labels and positions, and the proof that packed examples do not attend to
each other (packed logits == each example run alone, on the tiny Llama in float32)."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from core.data.packing import (
    IGNORE_INDEX,
    best_fit_decreasing,
    block_causal_mask,
    collate_packed,
    layout_for,
    model_inputs,
    pack_examples,
)
from core.spec import SpecError, parse_job_spec
from tests.utils.tiny import sentences

MAX_LEN = 64


def test_best_fit_decreasing_fills_bins_within_capacity() -> None:
    lengths = [50, 10, 30, 34, 20, 14, 60, 4, 2]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # 224 tokens need at least 4 bins of 64; best fit finds exactly that.
    assert len(bins) == 4
    assert bins == best_fit_decreasing(lengths, 64)  # deterministic


def test_pack_examples_restart_positions_and_mask_each_first_label() -> None:
    exs = [
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
        {"input_ids": [4, 5], "labels": [IGNORE_INDEX, 5]},
    ]
    (row,) = pack_examples(exs, 8)
    assert row["input_ids"] == [1, 2, 3, 4, 5]
    assert row["position_ids"] == [0, 1, 2, 0, 1]
    # Token 4 must not be predicted from token 3 (another example): its label is -100.
    assert row["labels"] == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5]


def test_collate_pads_as_its_own_block_and_marks_real_tokens() -> None:
    rows = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "position_ids": [0, 1, 2]},
        {"input_ids": [4], "labels": [-100], "position_ids": [0]},
    ]
    b = collate_packed(rows, pad_token_id=0, layout="mask")
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[-100, 2, 3], [-100, -100, -100]]
    flat = collate_packed(rows, pad_token_id=0, layout="flat")
    assert flat["input_ids"].tolist() == [[1, 2, 3, 4]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0]]
    assert flat["attention_mask"].sum() == 4


def test_block_causal_mask_is_block_diagonal_and_causal() -> None:
    m = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]), torch.float32)
    assert m.shape == (1, 1, 5, 5)
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert m.min() == torch.finfo(torch.float32).min


def test_layout_follows_the_attention_kernel() -> None:
    def cfg(impl: str, **kw: Any) -> Any:
        return SimpleNamespace(_attn_implementation=impl, **kw)

    assert layout_for(cfg("sdpa"), 1024) == "mask"
    assert layout_for(cfg("eager"), 1024) == "mask"
    assert layout_for(cfg("flash_attention_2"), 1024) == "flat"
    assert layout_for(cfg("flex_attention"), 1024) == "position_ids"
    assert layout_for(cfg("sdpa", sliding_window=512), 1024) == "position_ids"
    assert layout_for(cfg("sdpa", sliding_window=4096), 1024) == "mask"
    assert layout_for(cfg("sdpa", sliding_window=512, use_sliding_window=False), 1024) == "mask"


def test_packing_with_virtual_tokens_is_refused_by_the_spec() -> None:
    with pytest.raises(SpecError) as info:
        parse_job_spec(
            {
                "model": {"name_or_path": "/m"},
                "dataset": {"path": "/d.jsonl", "packing": True},
                "peft": {"method": "prompt_tuning"},
            }
        )
    assert [p.param for p in info.value.problems] == ["dataset.packing"]


# ---------------------------------------------------------------- no cross-attention


@pytest.fixture(scope="module")
def examples(tiny_causal_lm: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    out = []
    for s in sentences(14, seed=11):
        ids = tok(s)["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def _alone(model: Any, examples: list[dict[str, Any]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples]


def _per_example(
    logits: torch.Tensor, rows: list[dict[str, Any]], flat: bool
) -> list[torch.Tensor]:
    """Slice packed logits back into examples, in packing order (positions restart at 0)."""
    out = []
    offset = 0
    for r, row in enumerate(rows):
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in itertools.pairwise(starts):
            out.append(logits[0, offset + a : offset + b] if flat else logits[r, a:b])
        offset += len(row["input_ids"])
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["mask", "flat", "position_ids"])
def test_packed_logits_equal_each_example_alone(
    attn: str, layout: str, tiny_causal_lm: Path, examples: list[dict[str, Any]]
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_causal_lm, attn_implementation=attn, dtype=torch.float32
    ).eval()
    model.config.use_cache = False  # as in training (core.train.model.load_model)
    rows = pack_examples(examples, MAX_LEN)
    assert len(rows) < len(examples) / 2  # several examples per row, so the test means something
    order = [
        examples[i]
        for b in best_fit_decreasing([len(e["input_ids"]) for e in examples], MAX_LEN)
        for i in b
    ]
    alone = _alone(model, order)

    batch = model_inputs(collate_packed(rows, 0, layout), layout, torch.float32)  # type: ignore[arg-type]
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).logits
    got = _per_example(packed, rows, flat=layout == "flat")
    assert len(got) == len(alone)
    worst = max(float((g - a).abs().max()) for g, a in zip(got, alone))
    assert worst < 1e-5, worst


def test_packed_loss_equals_the_unpacked_token_mean(
    tiny_causal_lm: Path, examples: list[dict[str, Any]]
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32).eval()
    model.config.use_cache = False
    rows = pack_examples(examples, MAX_LEN)
    batch = model_inputs(collate_packed(rows, 0, "mask"), "mask", torch.float32)
    with torch.no_grad():
        packed_loss = float(model(**batch).loss)
        total, count = 0.0, 0
        for e in examples:
            ids = torch.tensor([e["input_ids"]])
            n = ids.shape[1] - 1  # tokens predicted within the example
            total += float(model(input_ids=ids, labels=ids).loss) * n
            count += n
    assert abs(packed_loss - total / count) < 1e-5


def test_a_plain_padding_mask_would_leak_across_examples(
    tiny_causal_lm: Path, examples: list[dict[str, Any]]
) -> None:
    """The control: the same packed rows with the usual 2-D mask give other logits (the
    second example of a row sees the first), so the equality above is not vacuous."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32).eval()
    model.config.use_cache = False
    rows = pack_examples(examples, MAX_LEN)
    b = collate_packed(rows, 0, "mask")
    with torch.no_grad():
        leaky = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"],
        ).logits
    order = [
        examples[i]
        for bin_ in best_fit_decreasing([len(e["input_ids"]) for e in examples], MAX_LEN)
        for i in bin_
    ]
    alone = _alone(model, order)
    worst = max(float((g - a).abs().max()) for g, a in zip(_per_example(leaky, rows, False), alone))
    assert worst > 1e-2
