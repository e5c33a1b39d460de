"""Preparing chat data for training vs the tokenizer alone, on the same texts, same run.

Usage:
    python -m bench.data_prep                 # 100,000 chat rows
    python -m bench.data_prep --rows 20000 --template tagged

Builds offline a byte-level BPE tokenizer (16k vocabulary, trained on this Python
installation's own source text: varied words, code and punctuation, no <unk>) with a
ChatML template (``<|im_start|>`` / ``<|im_end|>`` special tokens, EOS = ``<|im_end|>``),
and writes a JSONL file of OpenAI-style chat rows (system, user, assistant; a third of the
rows two turns, some first answers with weight 0).

Measured, each on its own (best of --repeat):
* ftune: the trainer's data path, streamed from the file: read + check nothing twice,
  convert each row (core/data/formats), render with the chat template, find the assistant spans
  (the template has no {% generation %} markers: each turn found in the one rendering by
  the header and footer the template puts around it, or by rendering prefixes where it does
  not frame turns alike), tokenize, map the span boundaries to tokens, build the loss mask
  and labels, in batches of 1,000 rows (core/data/tokenize.py);
* tokenizer: the same rendered texts (rendered beforehand, not timed) through the
  tokenizer's own batch call (``tok(texts)``), 1,000 texts per call, no offsets: what the
  fastest possible data path would pay for tokenizing alone;
* rust: the same texts through the Rust tokenizer's ``encode_batch`` directly (no
  conversion of the encodings into Python lists): the stricter baseline.
The three passes alternate, --repeat times, best of each kept. The figures are ftune's
rows/s over each baseline's (target >= 0.7). Memory: the peak RSS growth while ftune
streams the file (it keeps only the current batch and the counts).

Prints a table and writes bench/results/data_prep-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.record import write_record

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TAGGED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus_lines(limit_bytes: int = 12 << 20) -> list[str]:
    """Lines of this Python installation's own .py files: real words, code, punctuation."""
    import sysconfig

    out: list[str] = []
    size = 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for line in text.splitlines():
            line = line.strip()
            if len(line) > 20:
                out.append(line)
                size += len(line)
        if size > limit_bytes:
            break
    return out


def build_tokenizer(out_dir: Path, lines: list[str], template: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=16000, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = template
    fast.save_pretrained(out_dir)
    return fast


def chat_rows(n: int, lines: list[str], seed: int = 0) -> Any:
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(lines) for _ in range(k))

    for i in range(n):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": text(1)}]
        for turn in range(2 if i % 3 == 0 else 1):
            msgs.append({"role": "user", "content": text(rng.randint(1, 3))})
            answer: dict[str, Any] = {"role": "assistant", "content": text(rng.randint(1, 4))}
            if turn == 0 and i % 6 == 0:
                answer["weight"] = 0
            msgs.append(answer)
        yield {"messages": msgs}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--template", choices=["chatml", "tagged"], default="chatml")
    args = p.parse_args()

    from core.data.files import check_rows, iter_examples
    from core.data.tokenize import TOKENIZE_BATCH, Tokenize
    from core.spec import JobSpec

    work = Path(tempfile.mkdtemp(prefix="ftune-data-prep-"))
    lines = corpus_lines()
    t0 = time.perf_counter()
    tok = build_tokenizer(work / "tok", lines, CHATML if args.template == "chatml" else TAGGED)
    print(f"tokenizer trained in {time.perf_counter() - t0:.1f}s ({len(tok)} tokens)")
    data = work / "chat.jsonl"
    with open(data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in chat_rows(args.rows, lines))
    spec = JobSpec.model_validate({
        "model": {"name_or_path": str(work / "tok")},
        "dataset": {"path": str(data), "format": "chat", "max_seq_length": 4096},
    })
    report = check_rows(data, spec.dataset)
    assert report.resolution is not None and not report.problem_count, report.problems[:3]
    res = report.resolution

    def ftune_pass() -> tuple[float, int, int, float]:
        tokenize = Tokenize(spec, tok, None)
        before = rss_mb()
        start = time.perf_counter()
        tokens = loss = 0
        batch: list[Any] = []
        rows: list[int] = []

        def flush() -> None:
            nonlocal tokens, loss
            st = tokenize(batch, rows, "chat").stats
            tokens += st.tokens
            loss += st.loss_tokens
            batch.clear()
            rows.clear()

        for row, ex in iter_examples(data, spec.dataset, res):
            batch.append(ex)
            rows.append(row)
            if len(batch) == TOKENIZE_BATCH:
                flush()
        if batch:
            flush()
        return time.perf_counter() - start, tokens, loss, rss_mb() - before

    # The baseline's texts: the same conversations, rendered beforehand (not timed).
    texts = [tok.apply_chat_template([{k: v for k, v in m.items() if k != "weight"}
                                      for m in r["messages"]], tokenize=False)
             for r in chat_rows(args.rows, lines)]

    def tokenizer_pass() -> tuple[float, int]:
        start = time.perf_counter()
        n = 0
        for i in range(0, len(texts), TOKENIZE_BATCH):
            n += sum(len(x) for x in tok(texts[i : i + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"])
        return time.perf_counter() - start, n

    def rust_pass() -> tuple[float, int]:
        # The Rust tokenizer alone (what ftune's path calls too), without transformers'
        # conversion of the encodings into Python lists: the stricter baseline.
        start = time.perf_counter()
        n = 0
        for i in range(0, len(texts), TOKENIZE_BATCH):
            encs = tok.backend_tokenizer.encode_batch(texts[i : i + TOKENIZE_BATCH], add_special_tokens=False)
            n += sum(len(e.ids) for e in encs)
        return time.perf_counter() - start, n

    # Interleaved, so that load from other processes drifting over time hits all alike.
    ours, base, rust = [], [], []
    for _ in range(args.repeat):
        ours.append(ftune_pass())
        base.append(tokenizer_pass())
        rust.append(rust_pass())
    t_ours = min(o[0] for o in ours)
    t_base = min(b[0] for b in base)
    t_rust = min(r[0] for r in rust)
    _, tokens, loss, grew = ours[0]
    result = {
        "rows": args.rows,
        "template": args.template,
        "tokens": tokens,
        "loss_tokens": loss,
        "baseline_tokens": base[0][1],
        "ftune_seconds": round(t_ours, 2),
        "tokenizer_seconds": round(t_base, 2),
        "rust_tokenizer_seconds": round(t_rust, 2),
        "ftune_rows_per_s": round(args.rows / t_ours),
        "tokenizer_rows_per_s": round(args.rows / t_base),
        "rust_tokenizer_rows_per_s": round(args.rows / t_rust),
        "ratio": round(t_base / t_ours, 3),
        "ratio_vs_rust": round(t_rust / t_ours, 3),
        "peak_rss_growth_mb": round(grew, 1),
        "file_mb": round(data.stat().st_size / 2**20, 1),
    }
    for k, v in result.items():
        print(f"{k:22} {v}")
    write_record("data_prep", result, args=args)


if __name__ == "__main__":
    main()
