"""Tiny models, tokenizers and datasets built offline, in about a second.

Used by `ftune demo` and by the tests. No hub access: a BPE tokenizer is trained on
generated sentences and wrapped in PreTrainedTokenizerFast; models come from small configs
with random weights, saved with save_pretrained so the trainer loads them by path exactly as
it would a real model.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = [
    "the", "a", "one", "two", "red", "blue", "green", "cat", "dog", "bird", "fish", "runs",
    "jumps", "sleeps", "eats", "sees", "likes", "big", "small", "happy", "sad", "fast", "slow",
    "tree", "house", "river", "hill", "sun", "moon", "star", "yes", "no", "good", "bad", "ok",
    "positive", "negative"
]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{% generation %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(n)]


def build_tokenizer(out_dir: Path, vocab_size: int = 256):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    # No progress bar: in a log or a pipe it is only blank lines.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False)
    tok.train_from_iterator(sentences(3000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def tiny_llama_config(**fields: Any):
    """The tiny Llama's config (2 layers, hidden 64, vocabulary 256); ``fields`` override
    or add to it. Config only: enough where a model is built on the meta device."""
    from transformers import LlamaConfig

    shape: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    }
    return LlamaConfig(**{**shape, **fields})


def build_llama(out_dir: Path, *, seed: int = 0, vocab_size: int = 256, **fields: Any) -> Path:
    """A Llama with random weights and its tokenizer (``vocab_size`` is the tokenizer's):
    the tiny shape, or the one ``fields`` give (config fields, as tiny_llama_config)."""
    import torch
    from transformers import LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, vocab_size=vocab_size)
    torch.manual_seed(seed)
    cfg = tiny_llama_config(**{
        "vocab_size": len(tok),
        "max_position_embeddings": 512,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "tie_word_embeddings": False,
        **fields,
    })
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


def build_causal_lm(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (~100k parameters) with its tokenizer."""
    return build_llama(out_dir, seed=seed)


def build_seq2seq_lm(out_dir: Path, seed: int = 0) -> Path:
    """A tiny T5 with the same tokenizer."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=len(tok),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        # Not a declared field: transformers' configs take extra kwargs at runtime
        # (accept_kwargs=True), which their dataclass_transform typing does not say.
        decoder_start_token_id=tok.pad_token_id,  # type: ignore[call-arg]
    )
    T5ForConditionalGeneration(cfg).save_pretrained(out_dir)
    return out_dir


def build_seq_cls(out_dir: Path, num_labels: int = 2, seed: int = 0) -> Path:
    """A tiny BERT encoder with a classification head."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        num_labels=num_labels,  # type: ignore[call-arg]  # a kwarg, as above
    )
    BertForSequenceClassification(cfg).save_pretrained(out_dir)
    return out_dir


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text_rows(n: int = 64, seed: int = 1) -> list[dict]:
    return [{"text": s} for s in sentences(n, seed)]


def prompt_completion_rows(n: int = 64, seed: int = 2) -> list[dict]:
    return [{"prompt": s, "completion": " yes"} for s in sentences(n, seed)]


def seq2seq_rows(n: int = 64, seed: int = 3) -> list[dict]:
    return [{"input": s, "target": s.split()[0]} for s in sentences(n, seed)]


def classification_rows(n: int = 64, seed: int = 4) -> list[dict]:
    rows = []
    for s in sentences(n, seed):
        label = "positive" if "good" in s or "happy" in s or len(s) % 2 else "negative"
        rows.append({"text": s, "label": label})
    return rows


def chat_rows(n: int = 64, seed: int = 5) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": s}, {"role": "assistant", "content": "ok"}]}
        for s in sentences(n, seed)
    ]


def preference_rows(n: int = 64, seed: int = 6, chat: bool = False) -> list[dict]:
    """Pairs that prefer a kind answer (" good happy sun") to an unkind one (" bad sad
    moon"): a direction a preference objective must learn. ``chat``: the prompt as a user
    message, the answers as text (one assistant turn each)."""
    rows = []
    for s in sentences(n, seed):
        prompt: Any = [{"role": "user", "content": s}] if chat else s
        rows.append({"prompt": prompt, "chosen": " good happy sun", "rejected": " bad sad moon"})
    return rows


def kto_rows(n: int = 64, seed: int = 7) -> list[dict]:
    """Unpaired rows (KTO): the kind answer labelled desirable, the unkind one not."""
    rows = []
    for i, s in enumerate(sentences(n, seed)):
        good = i % 2 == 0
        answer = " good happy sun" if good else " bad sad moon"
        rows.append({"prompt": s, "completion": answer, "label": good})
    return rows
