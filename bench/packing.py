"""Padded vs packed training throughput: real (non-pad) tokens per second.

Usage:
    python -m bench.packing                       # CPU: 4-layer 256-hidden Llama, 12 steps
    python -m bench.packing --steps 30 --max-seq-length 1024 --attn eager
    python -m bench.packing --layers 2 --hidden 64   # the tests' tiny Llama shape
    python -m bench.packing --jobs                # whole jobs through python -m core.train

Builds a small Llama offline (random weights, the tests' BPE tokenizer) and a synthetic
causal-LM text set whose lengths are long-tailed, as instruction data is (most examples
short, a few near max_seq_length). Both modes train LoRA (r=8, all-linear) for the same
number of optimizer steps with the same number of rows per step: dynamic padding (one
example per row, padded to the longest in the batch) and packing (several examples per row,
core/data/packing.py, with the attention layout the trainer picks for the model).

Default: one process, one model; padded and packed steps *alternate* (forward, backward,
AdamW step), each timed on its own, through the trainer's own data path (tokenize_rows,
PadCollator, pack_examples, packing.model_inputs). On a shared machine, load from other
processes then slows both modes alike; the rate is real tokens (the collated 2-D mask, as
the Trainer counts them) over the summed step times, warm-up steps left out.

``--jobs``: instead, two whole jobs (dataset.packing false, then true) run as the worker
runs them, ``python -m core.train <job_dir>``; the rates come from each job's events.jsonl
(tokens_seen, elapsed_seconds; the median per-step rate is shown too). Closer to what a user
sees, but sensitive to other load on the machine.

Also computed from the data itself: the share of real tokens in padded batches and the fill
of the packed rows, which is where the speedup comes from. With sdpa/eager the attention of
a packed row is computed densely over the whole row (the masked scores are computed, then
discarded), so the gain shrinks as max_seq_length grows past the typical example; the
variable-length flash kernel (layout "flat") computes only the per-example blocks.

Measured on the 2-core CPU dev machine (4 layers, hidden 256, float32, 12 steps, 8 rows per
step, mean example 47 tokens): padded batches 37% real tokens, packed rows 100% full;
real tokens/s padded 815 -> packed 1742 (2.14x) with sdpa, 2.03x with eager; 2.06x as
whole jobs (--jobs); at max_seq_length 1024 (mean 93 tokens) 1.55x.

Prints a table and writes bench/results/packing-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from bench.harness import llama, llama_shape, run_trainer, write_plan
from bench.record import write_record
from cli.demo_assets import WORDS


def synthetic_rows(n: int, max_words: int, seed: int) -> list[dict[str, str]]:
    """Text rows with long-tailed lengths: log-normal word counts (median ~max_words/8)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = int(min(max_words, max(4, rng.lognormvariate(math.log(max_words / 8), 0.9))))
        rows.append({"text": " ".join(rng.choice(WORDS) for _ in range(words))})
    return rows


def data_figures(model: Path, rows: list[dict[str, str]], max_len: int, batch: int) -> dict:
    """Padding share of random padded batches, and the fill of packed rows."""
    from transformers import AutoTokenizer

    from core.data.packing import best_fit_decreasing

    tok = AutoTokenizer.from_pretrained(model)
    lengths = [min(max_len, len(tok(r["text"])["input_ids"]) + 1) for r in rows]
    order = list(range(len(lengths)))
    random.Random(0).shuffle(order)
    padded = real = 0
    for i in range(0, len(order) - batch + 1, batch):
        b = [lengths[j] for j in order[i : i + batch]]
        padded += max(b) * len(b)
        real += sum(b)
    bins = best_fit_decreasing(lengths, max_len)
    return {
        "examples": len(lengths),
        "tokens": sum(lengths),
        "mean_length": round(sum(lengths) / len(lengths), 1),
        "max_length": max(lengths),
        "padded_batches_real_share": round(real / padded, 3),
        "packed_rows": len(bins),
        "examples_per_packed_row": round(len(lengths) / len(bins), 2),
        "packed_rows_fill": round(sum(lengths) / (len(bins) * max_len), 3),
    }


def run_job(
    root: Path, model: Path, data: Path, packing: bool, args: argparse.Namespace
) -> dict[str, Any]:
    job = root / ("packed" if packing else "padded")
    job.mkdir(parents=True)
    spec = {
        "model": {
            "name_or_path": str(model),
            "task": "causal_lm",
            "dtype": "float32",
            "attn_implementation": args.attn,
        },
        "dataset": {
            "path": str(data),
            "format": "text",
            "max_seq_length": args.max_seq_length,
            "packing": packing,
        },
        "peft": {
            "method": "lora",
            "r": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "target_modules": "all-linear",
        },
        "training": {
            "max_steps": args.steps,
            "per_device_train_batch_size": args.batch,
            "learning_rate": 1e-3,
            "logging_steps": args.steps,
            "save_steps": 10**6,
            "seed": 0,
        },
    }
    write_plan(job, spec, model=model, train=data, device="cuda" if args.gpu else "cpu")
    # The environment's thread count, not the trainer tests' one thread (testkit/launch.py).
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    run = run_trainer(job, env=env)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        raise SystemExit(f"{job.name} run failed (exit {run.returncode})")
    events = run.events
    started = next(e for e in events if e["type"] == "started")
    progress = [e for e in events if e["type"] == "progress"]
    last = progress[-1]
    # Per-step rates (real tokens of the step / its seconds), first step (warm-up) left out;
    # their median shrugs off bursts of load from other processes on a shared machine.
    rates = [
        (b["tokens_seen"] - a["tokens_seen"]) / (b["elapsed_seconds"] - a["elapsed_seconds"])
        for a, b in itertools.pairwise(progress)
        if b["elapsed_seconds"] > a["elapsed_seconds"]
    ]
    return {
        "mode": job.name,
        "steps": last["step"],
        "rows_per_step": args.batch,
        "real_tokens": last["tokens_seen"],
        "train_seconds": last["elapsed_seconds"],
        "tokens_per_second": round(last["tokens_seen"] / last["elapsed_seconds"], 1),
        "median_step_tokens_per_second": round(statistics.median(rates), 1),
        "examples_per_step": round(
            last["tokens_seen"] / last["step"] / (started["tokens"] / started["examples"]), 2
        ),
        "packing_layout": started.get("packing"),
        "process_seconds": round(run.wall_seconds, 1),
        "process_cpu_seconds": round(run.cpu_seconds, 1),
    }


def interleaved(
    model_dir: Path, rows: list[dict[str, str]], args: argparse.Namespace
) -> list[dict]:
    """Alternate padded and packed training steps on one LoRA model; time each step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.data.collator import PadCollator
    from core.data.packing import layout_for, model_inputs, pack_examples
    from core.data.tokenize import tokenize_rows
    from core.spec import parse_job_spec

    device = "cuda" if args.gpu else "cpu"
    spec = parse_job_spec(
        {
            "model": {"name_or_path": str(model_dir)},
            "dataset": {"path": "x.jsonl", "max_seq_length": args.max_seq_length},
        }
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_rows(spec, tok, rows).examples
    packed_rows = pack_examples(examples, args.max_seq_length)
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=args.attn
    )
    base.config.use_cache = False
    layout = layout_for(base.config, args.max_seq_length)
    lora = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear")
    model = get_peft_model(base, lora).to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    collate = PadCollator(tok.pad_token_id, layout=layout)
    rng = random.Random(0)
    rng.shuffle(examples)
    rng.shuffle(packed_rows)

    def batches(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        n = args.batch
        return [collate(items[i : i + n]) for i in range(0, len(items) - n + 1, n)]

    feeds = {"padded": batches(examples), "packed": batches(packed_rows)}
    warmup = 2
    steps = warmup + args.steps
    for mode, feed in feeds.items():
        if len(feed) < steps:
            raise SystemExit(f"{mode}: {len(feed)} batches, need {steps}: raise --examples")
    times: dict[str, list[float]] = {m: [] for m in feeds}
    tokens: dict[str, list[int]] = {m: [] for m in feeds}
    for i in range(steps):
        for mode, feed in feeds.items():
            batch = feed[i]
            real = int(batch["attention_mask"].sum())  # before the packed-mask conversion
            batch = {k: v.to(device) for k, v in batch.items()}
            if "position_ids" in batch:
                batch = model_inputs(batch, layout, torch.float32)
            if args.gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.gpu:
                torch.cuda.synchronize()
            if i >= warmup:
                times[mode].append(time.perf_counter() - t0)
                tokens[mode].append(real)
    return [
        {
            "mode": mode,
            "steps": args.steps,
            "rows_per_step": args.batch,
            "packing_layout": layout if mode == "packed" else None,
            "real_tokens": sum(tokens[mode]),
            "train_seconds": round(sum(times[mode]), 3),
            "tokens_per_second": round(sum(tokens[mode]) / sum(times[mode]), 1),
            "median_step_tokens_per_second": round(
                statistics.median(t / s for t, s in zip(tokens[mode], times[mode])), 1
            ),
            "examples_per_step": round(
                len(examples) / len(packed_rows) * args.batch if mode == "packed" else args.batch,
                2,
            ),
        }
        for mode in feeds
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="rows per step, both modes")
    ap.add_argument("--max-seq-length", type=int, default=512)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--gpu", action="store_true", help="runtime.device cuda")
    ap.add_argument("--jobs", action="store_true", help="whole jobs via python -m core.train")
    ap.add_argument("--repeats", type=int, default=2, help="--jobs: runs per mode (best kept)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="ftune-bench-packing-") as tmp:
        root = Path(tmp)
        model = llama(root / "model", max_position_embeddings=8192,
                      **llama_shape(args.hidden, args.layers))
        rows = synthetic_rows(args.examples, max_words=args.max_seq_length // 2, seed=1)
        data = root / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        figures = data_figures(model, rows, args.max_seq_length, args.batch)
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        if args.jobs:
            # Alternate whole jobs and keep each mode's best (median-step) run.
            for i in range(args.repeats):
                for p in (False, True):
                    runs[p].append(run_job(root / f"run{i}", model, data, p, args))
            key = "median_step_tokens_per_second"
            results = [max(runs[p], key=lambda r: r[key]) for p in (False, True)]
        else:
            key = "tokens_per_second"
            results = interleaved(model, rows, args)

    padded, packed = results
    speedup = packed[key] / padded[key]
    how = (
        f"whole jobs, best of {args.repeats} alternating runs per mode"
        if args.jobs
        else "alternating steps in one process"
    )
    print(
        f"model: Llama {args.layers} layers, hidden {args.hidden}, attention {args.attn}, "
        f"LoRA r=8 all-linear, float32, {'cuda' if args.gpu else 'cpu'} "
        f"({os.cpu_count()} cores); {how}"
    )
    print(
        f"data: {figures['examples']} examples, mean {figures['mean_length']} tokens, "
        f"max {figures['max_length']}, max_seq_length {args.max_seq_length}; padded batches "
        f"are {figures['padded_batches_real_share']:.0%} real tokens; packed rows hold "
        f"{figures['examples_per_packed_row']} examples and are "
        f"{figures['packed_rows_fill']:.0%} full"
    )
    print(
        f"{'mode':8} {'steps':>5} {'rows/step':>9} {'examples/step':>13} {'real tokens':>11} "
        f"{'seconds':>8} {'real tokens/s':>13} {'median step':>11}"
    )
    for r in results:
        print(
            f"{r['mode']:8} {r['steps']:>5} {r['rows_per_step']:>9} {r['examples_per_step']:>13} "
            f"{r['real_tokens']:>11} {r['train_seconds']:>8.1f} {r['tokens_per_second']:>13.1f} "
            f"{r['median_step_tokens_per_second']:>11.1f}"
        )
    print(f"speedup (real tokens/s, packed / padded): {speedup:.2f}x")

    write_record(f"packing-{'cuda' if args.gpu else 'cpu'}", results, args=args, data=figures,
                 method=how, all_runs=runs[False] + runs[True], speedup=round(speedup, 3))


if __name__ == "__main__":
    main()
