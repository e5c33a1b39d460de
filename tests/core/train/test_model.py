"""Loading the base: a rank that reads no weights (FSDP2 cpu_ram_efficient_loading) builds the
same module tree as rank 0, tied weights included."""

from __future__ import annotations

from pathlib import Path

from core.data.tokenizer import load_tokenizer
from core.spec import parse_job_spec
from core.train.model import load_model


def test_a_rank_without_weights_ties_the_lm_head_as_rank_0_does(tiny_tied_causal_lm: Path) -> None:
    # transformers 5.23 ties tie_word_embeddings in from_pretrained, not from_config: an
    # untied LM head on such a rank broke FSDP2's wrapping ("Parameters missing after
    # FSDP2 wrapping: ['base_model.model.lm_head.weight']").
    spec = parse_job_spec({"model": {"name_or_path": str(tiny_tied_causal_lm)},
                           "dataset": {"path": "/d.jsonl"}})
    tok = load_tokenizer(spec, str(tiny_tied_causal_lm))
    read = load_model(spec, str(tiny_tied_causal_lm), tok, None)
    empty = load_model(spec, str(tiny_tied_causal_lm), tok, None, read_weights=False)
    assert read.lm_head.weight is read.model.embed_tokens.weight
    assert empty.lm_head.weight is empty.model.embed_tokens.weight
    assert [(n, p.shape) for n, p in empty.named_parameters()] == [
        (n, p.shape) for n, p in read.named_parameters()]
