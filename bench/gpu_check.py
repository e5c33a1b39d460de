"""A GPU check for the day one is lent: one script, nothing downloaded, one table.

Usage:
    python -m bench.gpu_check            # one CUDA GPU: a ~1.1B Llama (TinyLlama's shape,
                                         # random weights, bf16), sequences of 1024, batch 4
    python -m bench.gpu_check --cpu      # the same rows on a tiny Llama on CPU (what CI runs,
                                         # tests/bench/test_gpu_check.py, so it cannot rot)
    python -m bench.gpu_check --only lora,qlora --steps 30

The model is built from its config (no hub), with the repo's BPE tokenizer
(cli/demo_assets.py) in front of a 32k vocabulary; every row is long enough to be cut at
max_seq_length, so each step trains exactly batch x max_seq_length tokens, no padding.

Rows (each a whole ftune job, launched as the worker launches one, unless said):
* lora (sdpa), lora (flash_attention_2, when flash_attn imports): LoRA r=16 on all linear
  layers, bf16 mixed precision; beside it a plain transformers Trainer on the same model,
  LoRA config, batch, sequence and steps, in this process: tokens/s of both and the ratio.
* full: every parameter trained (``peft.method: full``; fp32 master weights under bf16
  autocast). The same plain Trainer baseline.
* full-bf16 (GPU only): the same with ``model.dtype: bfloat16``: the weights and Adam's
  moments in bf16, as the baseline trains them (the full row keeps fp32 master weights).
* qlora: the base in 4-bit NF4 (bitsandbytes), LoRA on top.
* fsdp2 offload: FSDP2 on one process with parameters and optimizer offloaded to the CPU
  (CPU mode: FSDP2 on 2 CPU processes over gloo, nothing to offload to).
Peak GPU memory (CPU mode: none) of each ftune row against ``ftune estimate``'s prediction
for the same spec (core/model/estimate.py), and the ratio.

Prints the table and writes bench/results/gpu_check-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]

from transformers import TrainerCallback

from bench.harness import llama, run_trainer, write_plan
from bench.record import write_record
from cli.demo_assets import WORDS, write_jsonl

ROWS = ("lora", "lora-flash", "full", "full-bf16", "qlora", "fsdp2-offload")
FULL_ROWS = ("full", "full-bf16")

# TinyLlama-1.1B's shape: 22 layers, hidden 2048, GQA 32/4 heads, MLP 5632, vocab 32000.
GPU_MODEL: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
CPU_MODEL: dict[str, Any] = {"vocab_size": 512, "max_position_embeddings": 256}


def build_model(out: Path, cpu: bool) -> Path:
    """Random weights from the config, saved in bf16 (float32 on CPU) with the tokenizer."""
    import torch

    if cpu:
        return llama(out, **CPU_MODEL)
    return llama(out, device="cuda", dtype=torch.bfloat16, **GPU_MODEL)


def long_rows(n: int, words: int) -> list[dict[str, str]]:
    """Rows of ``words`` words: longer than max_seq_length tokens, so every one is cut."""
    import random

    rng = random.Random(0)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(words))} for _ in range(n)]


def spec_for(row: str, model: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    lora = {"method": "lora", "r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
            "target_modules": "all-linear"}  # fmt: skip
    model_spec: dict[str, Any] = {"name_or_path": str(model)}
    if not args.cpu:
        model_spec["attn_implementation"] = "flash_attention_2" if row == "lora-flash" else "sdpa"
    if row == "full-bf16":  # the weights trained in bf16 themselves, as the baseline's
        model_spec["dtype"] = "bfloat16"
    if row == "qlora":
        model_spec["quantization"] = {
            "load_in": "4bit", "quant_type": "nf4",
            **({} if args.cpu else {"compute_dtype": "bfloat16"}),
        }  # fmt: skip
    distributed: dict[str, Any] = {"strategy": "none", "num_processes": 1}
    if row == "fsdp2-offload":
        distributed = {
            "strategy": "fsdp",
            "num_processes": 2 if args.cpu else 1,
            "fsdp": {"version": 2, "offload_params": not args.cpu,
                     "cpu_ram_efficient_loading": False},
        }  # fmt: skip
    return {
        "model": model_spec,
        "dataset": {"path": str(data), "format": "text", "max_seq_length": args.seq},
        "peft": {"method": "full"} if row in FULL_ROWS else lora,
        "training": {
            "max_steps": args.steps,
            "per_device_train_batch_size": args.batch,
            "learning_rate": 1e-4,
            "logging_steps": 1,
            "save_steps": 10**6,
            "seed": 0,
            "mixed_precision": "no" if args.cpu else "bf16",
        },
        "distributed": distributed,
    }


def estimate_mb(spec: dict[str, Any], model: Path) -> float | None:
    from core.model.estimate import estimate
    from core.spec import parse_job_spec

    try:
        return round(estimate(parse_job_spec(spec), str(model)).gpu_total_mb, 1)
    except Exception as e:  # noqa: BLE001 - a row without an estimate still has its speed
        print(f"  (no estimate: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def run_ftune(root: Path, row: str, model: Path, data: Path, args: argparse.Namespace) -> dict:
    """One ftune job, launched as the worker does; tokens/s and peak GPU MB from its events."""
    from testkit.launch import write_launch_files

    job = root / row
    spec = spec_for(row, model, data, args)
    device: Literal["cpu", "cuda"] = "cpu" if args.cpu else "cuda"
    write_plan(job, spec, model=model, train=data, device=device, job_id=f"gpu-check-{row}",
               cpu_fsdp2=args.cpu)
    argv, env = write_launch_files(job, device=device)
    if not args.cpu:
        env.pop("OMP_NUM_THREADS", None)
    run = run_trainer(job, argv=argv, env=env)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-3000:])
        return {"row": row, "error": f"exit {run.returncode}"}
    events = run.events
    progress = [e for e in events if e["type"] == "progress" and "loss" in e]
    memory = [e for e in events if e["type"] == "memory" and e["phase"] == "train"]
    return {
        "row": row,
        "tokens_per_second": _steady_rate(progress),
        "final_loss": round(progress[-1]["loss"], 4),
        "peak_gpu_mb": max((m.get("gpu_mb_peak") or 0.0) for m in memory) or None,
        "estimate_gpu_mb": estimate_mb(spec, model),
        "wall_seconds": round(run.wall_seconds, 1),
        "cpu_seconds": round(run.cpu_seconds, 1),
    }


def _steady_rate(progress: list[dict[str, Any]]) -> float | None:
    """Tokens/s from the second logged step to the last (the first holds warm-up).

    Timed by the events' own ``time`` stamps (full clock precision): ``elapsed_seconds`` is
    rounded to 10 ms, so on a fast machine two tiny CPU steps could read as no time at all."""
    if len(progress) < 2:
        return None
    a, b = progress[0], progress[-1]
    dt = b["time"] - a["time"]
    return round((b["tokens_seen"] - a["tokens_seen"]) / dt, 1) if dt > 0 else None


class Rate(TrainerCallback):
    """Tokens/s of a Trainer from the end of step 1 to the last step (the first holds
    warm-up), every step being batch x max_seq_length tokens."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.t1: float | None = None
        self.steps = 0
        self.seconds = 0.0

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        _sync()
        now = time.monotonic()
        if self.t1 is None:
            self.t1 = now
        else:
            self.steps, self.seconds = state.global_step - 1, now - self.t1

    def rate(self) -> float | None:
        if not self.seconds:
            return None
        return round(self.steps * self.tokens_per_step / self.seconds, 1)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_baseline(row: str, model_dir: Path, rows: list[dict[str, str]],
                 args: argparse.Namespace) -> dict:
    """The plain transformers Trainer on the row's model (LoRA unless a full row), in this
    process: bf16 weights on a GPU, as a plain script loads them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(r["text"], truncation=True, max_length=args.seq)["input_ids"] for r in rows]
    examples = [{"input_ids": x, "labels": list(x)} for x in ids]
    kwargs: dict[str, Any] = {}
    if not args.cpu:
        kwargs = {"dtype": torch.bfloat16,
                  "attn_implementation": "flash_attention_2" if row == "lora-flash" else "sdpa"}
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if row not in FULL_ROWS:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules="all-linear"))  # fmt: skip
    if not args.cpu:
        model = model.cuda()
    targs = TrainingArguments(
        output_dir=str(args.tmp / f"baseline-{row}"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, learning_rate=1e-4, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=args.cpu,
        bf16=not args.cpu, seed=0, remove_unused_columns=False,
    )  # fmt: skip
    rate = Rate(args.batch * args.seq)
    from transformers import default_data_collator

    trainer = Trainer(model=model, args=targs, train_dataset=examples,
                      data_collator=default_data_collator, callbacks=[rate])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    out = {"tokens_per_second": rate.rate(), "peak_gpu_mb": round(peak, 1) if peak else None}
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny Llama on CPU (the CI mode)")
    ap.add_argument("--steps", type=int, default=None, help="default: 20 on GPU, 3 on CPU")
    ap.add_argument("--batch", type=int, default=None, help="default: 4 on GPU, 2 on CPU")
    ap.add_argument("--seq", type=int, default=None, help="default: 1024 on GPU, 32 on CPU")
    ap.add_argument("--only", default=",".join(ROWS), help="comma-separated rows")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results",
                    help="where the JSON record goes")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.cpu else 20)
    args.batch = args.batch or (2 if args.cpu else 4)
    args.seq = args.seq or (32 if args.cpu else 1024)
    rows = [r.strip() for r in args.only.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown rows: {', '.join(unknown)} (known: {', '.join(ROWS)})")
    import torch

    if args.cpu:
        # The trainer runs with OMP_NUM_THREADS=1 (testkit/launch.py): the in-process
        # Trainer too, or the comparison is of thread counts.
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu")
    notes: list[str] = []
    if "lora-flash" in rows and (args.cpu or not flash_attn_importable()):
        rows.remove("lora-flash")
        notes.append("lora-flash left out: flash_attn does not import here")
    if "full-bf16" in rows and args.cpu:
        rows.remove("full-bf16")
        notes.append("full-bf16 left out: 16-bit weights are trained on a GPU")

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ftune-gpu-check-") as tmp:
        args.tmp = Path(tmp)
        model = build_model(args.tmp / "model", args.cpu)
        data_rows = long_rows(max(64, args.steps * args.batch * 2), words=args.seq * 2)
        data = write_jsonl(args.tmp / "train.jsonl", data_rows)
        for row in rows:
            t0 = time.monotonic()
            r = run_ftune(args.tmp / "jobs", row, model, data, args)
            if row in ("lora", "lora-flash", *FULL_ROWS) and "error" not in r:
                base = run_baseline(row, model, data_rows, args)
                r["trainer_tokens_per_second"] = base["tokens_per_second"]
                r["trainer_peak_gpu_mb"] = base["peak_gpu_mb"]
            r["seconds"] = round(time.monotonic() - t0, 1)
            results.append(r)
            print(f"  {row}: {r}", file=sys.stderr)

    def fmt(v: Any) -> str:
        return "-" if v is None else str(v)

    cols = ["row", "ftune tok/s", "Trainer tok/s", "vs Trainer", "peak GPU MB",
            "estimate MB", "peak/estimate", "seconds"]  # fmt: skip
    print(" | ".join(cols))
    for r in results:
        ours, theirs = r.get("tokens_per_second"), r.get("trainer_tokens_per_second")
        peak, est = r.get("peak_gpu_mb"), r.get("estimate_gpu_mb")
        print(" | ".join(fmt(x) for x in (
            r["row"], r.get("error") or ours, theirs,
            f"{ours / theirs:.2f}x" if ours and theirs else None, peak, est,
            f"{peak / est:.2f}" if peak and est else None, r["seconds"],
        )))  # fmt: skip
    for n in notes:
        print(f"note: {n}")
    write_record(f"gpu_check-{'cpu' if args.cpu else 'gpu'}", results, folder=args.results,
                 args={k: str(v) for k, v in vars(args).items() if k != "tmp"},
                 gpu=_gpu_name(), notes=notes)  # fmt: skip
    return 1 if any("error" in r for r in results) else 0


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


if __name__ == "__main__":
    sys.exit(main())
