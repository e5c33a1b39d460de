"""Training methods side by side: LoRA vs QLoRA (4-bit NF4 base), and SFT vs DPO, on the
same data, as whole jobs.

Usage:
    python -m bench.methods                        # CPU: 4-layer 512-hidden Llama, 12 steps
    python -m bench.methods --steps 30 --hidden 1024
    python -m bench.methods --gpu                  # runtime.device cuda (GPU figures)
    python -m bench.methods --only sft-lora,dpo-lora

Builds a Llama offline (random weights, the tests' BPE tokenizer) and one synthetic file of
preference pairs (prompt, chosen, rejected). Each method trains LoRA (r=8, all-linear) for
the same number of optimizer steps with the same rows per step, run as the worker runs a
job (``python -m core.train <job_dir>``):

* sft-lora / sft-qlora: supervised on (prompt, chosen) (format prompt_completion with
  completion_field "chosen"), on a float32 base / a 4-bit NF4 base (bitsandbytes);
* dpo-lora / dpo-qlora: DPO (sigmoid, beta 0.1) on (prompt, chosen, rejected).

Figures, from each job's events.jsonl:
* rows/s: training rows per second (DPO: pairs) over the training phase;
* tokens/s: input tokens the Trainer counted (DPO feeds prompt+chosen and prompt+rejected,
  so about twice SFT's per row); the median per-step rate is shown too (bursts of load from
  other processes on a shared machine move it less);
* params MB: bytes of the model's parameters as loaded (exact: float32 vs packed 4-bit
  weights plus the float32 adapter);
* load MB: memory the model load added (CPU RSS; GPU allocated with --gpu). On CPU a 4-bit
  load first reads float32 weights, then quantizes them;
* train peak MB: peak during training over the memory at its start (activations,
  gradients, optimizer; DPO's reference pass adds forwards, not a second model);
* ratios against sft-lora from the same run.

``--repeats N`` runs the methods N times in alternating order (A B C D, D C B A, ...) and
keeps each method's fastest run: on a shared machine, load from other processes only ever
slows a run down, so the best of a few is the closest to the method's own speed.

Prints a table and writes bench/results/methods-<device>-<time>.json. The measured table
is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from bench.harness import llama, llama_shape, run_trainer, write_plan
from bench.record import write_record
from cli.demo_assets import WORDS, write_jsonl

METHODS: dict[str, dict[str, Any]] = {
    "sft-lora": {"objective": "sft", "quantized": False},
    "sft-qlora": {"objective": "sft", "quantized": True},
    "dpo-lora": {"objective": "dpo", "quantized": False},
    "dpo-qlora": {"objective": "dpo", "quantized": True},
}


def pair_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Pairs with prompts of 8-40 words and answers of 8-24, chosen != rejected."""
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        chosen, rejected = " " + words(8, 24), " " + words(8, 24)
        rows.append({"prompt": words(8, 40), "chosen": chosen, "rejected": rejected})
    return rows


def job_spec(method: str, model: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    m = METHODS[method]
    dataset: dict[str, Any] = {"path": str(data), "max_seq_length": args.max_seq_length}
    if m["objective"] == "dpo":
        dataset["format"] = "preference"
    else:
        dataset.update(format="prompt_completion", completion_field="chosen")
    model_spec: dict[str, Any] = {"name_or_path": str(model), "dtype": "float32"}
    if m["quantized"]:
        model_spec["quantization"] = {"load_in": "4bit", "quant_type": "nf4"}
    return {
        "model": model_spec,
        "dataset": dataset,
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                 "target_modules": "all-linear"},
        "training": {
            "objective": m["objective"],
            "max_steps": args.steps,
            "per_device_train_batch_size": args.batch,
            "learning_rate": 1e-4,
            "logging_steps": 1,
            "save_steps": 10**6,
            "seed": 0,
        },
    }


def run_job(root: Path, method: str, model: Path, data: Path, args: argparse.Namespace) -> dict:
    job = root / method
    write_plan(job, job_spec(method, model, data, args), model=model, train=data,
               device="cuda" if args.gpu else "cpu")
    # The environment's thread count, not the trainer tests' one thread (testkit/launch.py).
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    run = run_trainer(job, env=env)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        raise SystemExit(f"{method} run failed (exit {run.returncode})")
    events = run.events
    progress = [e for e in events if e["type"] == "progress" and "loss" in e]
    started = next(e for e in events if e["type"] == "started")
    memory = {e["phase"]: e for e in events if e["type"] == "memory" and e.get("rank", 0) == 0}
    last = progress[-1]
    # Per-step rates, first step (warm-up) left out.
    rates = [
        (b["tokens_seen"] - a["tokens_seen"]) / (b["elapsed_seconds"] - a["elapsed_seconds"])
        for a, b in itertools.pairwise(progress)
        if b["elapsed_seconds"] > a["elapsed_seconds"]
    ]
    key = "gpu_mb" if args.gpu else "cpu_mb"
    load, train = memory["load"], memory["train"]
    return {
        "method": method,
        "steps": last["step"],
        "rows_per_second": round(last["step"] * args.batch / last["elapsed_seconds"], 2),
        "tokens_per_second": round(last["tokens_seen"] / last["elapsed_seconds"], 1),
        "median_step_tokens_per_second": round(statistics.median(rates), 1) if rates else None,
        "tokens_per_row": round(last["tokens_seen"] / (last["step"] * args.batch), 1),
        "params_mb": started["param_mb_per_rank"][0],
        "load_mb": round(load[f"{key}_end"] - load[f"{key}_begin"], 1),
        "train_peak_mb": round(train[f"{key}_peak"] - train[f"{key}_begin"], 1),
        "final_loss": round(last["loss"], 4),
        "reward_accuracy": last.get("reward_accuracy"),
        "process_cpu_seconds": round(run.cpu_seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="rows per step (DPO: pairs)")
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--gpu", action="store_true", help="runtime.device cuda")
    ap.add_argument("--only", default=",".join(METHODS), help="comma-separated methods")
    ap.add_argument("--repeats", type=int, default=2, help="runs per method (fastest kept)")
    args = ap.parse_args()
    methods = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods: {', '.join(unknown)} (known: {', '.join(METHODS)})")

    with tempfile.TemporaryDirectory(prefix="ftune-bench-methods-") as tmp:
        root = Path(tmp)
        model = llama(root / "model", max_position_embeddings=4096,
                      **llama_shape(args.hidden, args.layers))
        data = write_jsonl(root / "pairs.jsonl", pair_rows(args.rows))
        best: dict[str, dict[str, Any]] = {}
        for i in range(args.repeats):
            for m in methods if i % 2 == 0 else methods[::-1]:
                r = run_job(root / f"jobs-{i}", m, model, data, args)
                if m not in best or r["rows_per_second"] > best[m]["rows_per_second"]:
                    best[m] = r
        results = [best[m] for m in methods]

    base = next((r for r in results if r["method"] == "sft-lora"), results[0])
    cols = ["method", "rows/s", "tokens/s", "median step tok/s", "tok/row", "params MB",
            "load MB", "train peak MB", f"rows/s vs {base['method']}", "params vs", "peak vs"]
    print(" | ".join(cols))
    for r in results:
        def ratio(k: str, r: dict = r) -> str:
            return f"{r[k] / base[k]:.2f}x" if base[k] else "-"

        print(" | ".join(str(x) for x in (
            r["method"], r["rows_per_second"], r["tokens_per_second"],
            r["median_step_tokens_per_second"], r["tokens_per_row"], r["params_mb"],
            r["load_mb"], r["train_peak_mb"], ratio("rows_per_second"), ratio("params_mb"),
            ratio("train_peak_mb"),
        )))  # fmt: skip
    print()
    write_record(f"methods-{'gpu' if args.gpu else 'cpu'}", results, args=args)


if __name__ == "__main__":
    main()
