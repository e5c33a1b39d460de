"""ftune's trainer against the stack users would write: a plain transformers ``Trainer``
script and TRL's trainers, same model, data, steps and threads.

Usage:
    python -m bench.trainer_vs_plain                  # CPU, one thread, every case
    python -m bench.trainer_vs_plain --cases sft --steps 40
    python -m bench.trainer_vs_plain --threads 2 --memory-seq 4096

The model is a Llama with random weights and a 32,000-token vocabulary (the size of Llama
2's; the tests' BPE tokenizer uses the first ids, which changes nothing about the cost of
the head), LoRA r=16 on all linear layers, dropout 0, float32. Every run is its own process
with the same ``--threads`` (OMP/MKL and torch), the same seed, rows, batch and steps:

* ``sft`` (completion-only loss, prompt_completion rows: prompts of 8-60 words, answers of
  1-4): ftune's trainer (``python -m core.train <job_dir>``, as the worker runs it) against
  a plain ``Trainer`` + ``DataCollatorForSeq2Seq`` over the same tokenized examples, and
  TRL's ``SFTTrainer`` on the raw rows (completion-only loss, its default for them);
* ``chat`` (assistant-only loss, one user turn and one assistant turn): ftune against the
  plain ``Trainer`` on ftune's tokenized examples;
* ``dpo`` (sigmoid, beta 0.1): ftune against TRL's ``DPOTrainer`` as its docs write it (a
  PeftModel, no ref_model);
* ``memory``: one forward + backward on one 2,048-token row (--memory-seq) whose last 128
  tokens carry the loss, the plain head against ftune's fused head, each in a fresh
  process: peak RSS growth over the step (CPU; CUDA peak allocated with --gpu); for the
  loss step alone (the model without decoder layers, frozen: embedding, norm, head) and
  for the whole step of the LoRA model.

Before any ratio is printed, the script asserts that each pair trained on identical tokens
per step and logged equal losses (rel. 1e-3: float round-off grows over the steps); a pair
that differs is reported as such, without a ratio. ``--repeats N`` runs each trainer N
times in alternating order and keeps its fastest run. Speed is tokens/s over the steps after
--warmup (non-padding input tokens, as the Trainer counts them), from per-step timestamps.

Writes bench/results/trainer-vs-plain-<device>-<time>.json; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from bench.harness import llama, llama_shape, run_trainer, write_plan
from bench.record import write_record
from cli.demo_assets import WORDS, write_jsonl
from core.run.plan import RunPlan

LORA: dict[str, Any] = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LR = 1e-3
SEED = 0


# ---------------------------------------------------------------------------- data and jobs


def build_model(out: Path, args: argparse.Namespace) -> Path:
    """A Llama with a --vocab-wide head and the tests' BPE tokenizer (its ids are the
    first 1,024 of the vocabulary)."""
    return llama(out, tokenizer_vocab=1024, seed=SEED, vocab_size=args.vocab,
                 max_position_embeddings=max(4096, args.memory_seq),
                 **llama_shape(args.hidden, args.layers))


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def rows_for(case: str, n: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        prompt, answer = _words(rng, 8, 60), " " + _words(rng, 1, 4)
        if case == "chat":
            rows.append({"messages": [{"role": "user", "content": prompt},
                                      {"role": "assistant", "content": answer.strip()}]})
        elif case == "dpo":
            rows.append({"prompt": prompt, "chosen": answer, "rejected": " " + _words(rng, 1, 4)})
        else:
            rows.append({"prompt": prompt, "completion": answer})
    return rows


FORMATS = {"sft": "prompt_completion", "chat": "chat", "dpo": "preference"}


def write_job(root: Path, case: str, model: Path, data: Path, args: argparse.Namespace) -> Path:
    job = root / f"job-{case}"
    spec = {
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "dataset": {"path": str(data), "format": FORMATS[case],
                    "max_seq_length": args.max_seq_length},
        "peft": {"method": "lora", **LORA},
        "training": {
            "objective": "dpo" if case == "dpo" else "sft",
            "max_steps": args.steps,
            "per_device_train_batch_size": args.batch,
            "learning_rate": LR,
            "logging_steps": 1,
            "save_steps": 10**6,
            "seed": SEED,
        },
    }
    write_plan(job, spec, model=model, train=data, device="cuda" if args.gpu else "cpu",
               job_id=f"bench-{case}")
    return job


def env_for(threads: int) -> dict[str, str]:
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
    )


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{what} failed (exit {proc.returncode})")


def run_ftune(job: Path, threads: int) -> dict[str, Any]:
    """The job as the worker runs it; per-step figures from its events.jsonl."""
    import itertools


    # A fresh job directory per run (a run leaves events, checkpoints and an adapter).
    run_dir = next(p for i in itertools.count()
                   if not (p := job.parent / f"{job.name}-run{i}").exists())
    run_dir.mkdir()
    RunPlan.read(job / "spec.json").write(run_dir / "spec.json")
    job = run_dir
    run = run_trainer(job, env=env_for(threads))
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        raise SystemExit(f"ftune {job.name} failed (exit {run.returncode})")
    progress = run.of_type("progress")
    started = run.of_type("started")[0]
    return {
        "cpu_seconds": run.cpu_seconds,
        "lm_head": started.get("lm_head"),
        "tokens": [e["tokens_seen"] for e in progress],
        "times": [e["elapsed_seconds"] for e in progress],
        "losses": [e["loss"] for e in progress],
    }


def run_worker(kind: str, job: Path, threads: int, extra: list[str] | None = None) -> dict[str, Any]:
    env = env_for(threads)
    if kind == "memory":
        # glibc serves freed large blocks again from its heap once one was freed (its mmap
        # threshold grows), so RSS would keep the high-water mark of fragmentation; a fixed
        # threshold maps and unmaps every tensor, and the peak RSS follows the live tensors.
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.trainer_vs_plain", "--worker", kind, "--job", str(job), "--threads",
         str(threads), *(extra or [])],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    _check(proc, f"{kind} {job.name}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- workers


class _Steps:
    """A TrainerCallback (built lazily: transformers is imported in the worker only) that
    records each step's end time, the tokens seen so far and the logged loss."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class Steps(TrainerCallback):  # type: ignore[misc]
            def __init__(self) -> None:
                self.t0 = 0.0
                self.tokens: list[int] = []
                self.times: list[float] = []
                self.losses: list[float] = []

            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                self.t0 = time.time()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                self.tokens.append(int(state.num_input_tokens_seen))
                self.times.append(time.time() - self.t0)

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
                if logs and "loss" in logs:
                    self.losses.append(float(logs["loss"]))

        return Steps()


def _common_args(job: Any) -> dict[str, Any]:
    t = job.spec.training
    return {
        "output_dir": str(job.dir.root / "plain-out"),
        "max_steps": t.max_steps,
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": "linear",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": t.seed,
        "data_seed": t.seed,
        "use_cpu": job.runtime.device == "cpu",
        "include_num_input_tokens_seen": "non_padding",
    }


def _peft_model(path: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


def worker_plain(job_root: Path) -> dict[str, Any]:
    """A plain transformers Trainer script over ftune's tokenized examples."""
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from core.data.datasets import build_datasets
    from core.train.job import load_job

    job = load_job(job_root)
    tok = AutoTokenizer.from_pretrained(job.runtime.model_path)
    data = build_datasets(job.spec, job.runtime.train_path, None, tok)
    model = _peft_model(job.runtime.model_path)
    steps = _Steps()
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**_common_args(job), remove_unused_columns=False),
        train_dataset=data.train,
        data_collator=DataCollatorForSeq2Seq(tok, label_pad_token_id=-100),
        callbacks=[steps],
    )
    trainer.train()
    return {"tokens": steps.tokens, "times": steps.times, "losses": steps.losses}


def worker_trl(job_root: Path) -> dict[str, Any]:
    """TRL's SFTTrainer (prompt-completion rows) or DPOTrainer, as their docs write them."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from core.train.job import load_job

    job = load_job(job_root)
    tok = AutoTokenizer.from_pretrained(job.runtime.model_path)
    lines = Path(job.runtime.train_path).read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    model = _peft_model(job.runtime.model_path)
    common = {
        **_common_args(job),
        "max_length": job.spec.dataset.max_seq_length,
        "gradient_checkpointing": False,
        "bf16": False,
    }
    steps = _Steps()
    trainer: Any
    if job.spec.training.objective == "dpo":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(
            model=model,
            args=DPOConfig(**common, beta=0.1, disable_dropout=True),
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[steps],
        )
    else:
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, completion_only_loss=True, packing=False),
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[steps],
        )
    trainer.train()
    return {"tokens": steps.tokens, "times": steps.times, "losses": steps.losses}


def worker_memory(job_root: Path, fused: bool, scope: str, seq: int, labelled: int) -> dict[str, Any]:
    """One forward + backward of one ``seq``-token row whose last ``labelled`` tokens carry
    the loss; the peak memory it added.

    scope "step": the benchmark's model with its LoRA adapter (backbone activations
    included). scope "loss": the same embedding, norm and head with no decoder layer and
    frozen weights, the gradient flowing back to the embedding output: what is left is the
    loss step (head, log-softmax, their backward)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from core.train.job import load_job
    from core.train.loss import add_sft_lm_head

    job = load_job(job_root)
    gpu = job.runtime.device == "cuda"
    model: Any
    if scope == "loss":
        config = AutoConfig.from_pretrained(job.runtime.model_path)
        config.num_hidden_layers = 0
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).requires_grad_(False)
        model.enable_input_require_grads()
    else:
        model = _peft_model(job.runtime.model_path)
    if fused:
        add_sft_lm_head(model)
    device = "cuda" if gpu else "cpu"
    model.to(device)
    g = torch.Generator().manual_seed(0)
    extra = {"fused_lm_head": True} if fused else {}

    def row(n: int, labelled: int) -> tuple[Any, Any]:
        ids = torch.randint(3, 256, (1, n), generator=g).to(device)
        labels = ids.clone()
        labels[:, : n - labelled] = -100
        return ids, labels

    # A short step first: the first call maps library code and lazily built buffers into
    # memory, which would count as the measured step's peak otherwise.
    ids, labels = row(16, 4)
    model(input_ids=ids, labels=labels, **extra).loss.backward()
    model.zero_grad(set_to_none=True)
    ids, labels = row(seq, labelled)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        # Peak resident memory: large tensors are mapped and unmapped, so it shows the
        # step's peak (the process did nothing bigger before).
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss = model(input_ids=ids, labels=labels, **extra).loss
    loss.backward()
    if gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"peak_mb": round(peak / 2**20, 1), "loss": float(loss)}


def measure_memory(job: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scope in ("loss", "step"):
        runs = {
            path: run_worker("memory", job, args.threads,
                             ["--memory-seq", str(args.memory_seq), "--scope", scope]
                             + (["--fused"] if path == "fused" else []))
            for path in ("plain", "fused")
        }  # fmt: skip
        plain, fused = runs["plain"], runs["fused"]
        rel = abs(fused["loss"] - plain["loss"]) / abs(plain["loss"])
        assert rel < 1e-4, f"memory ({scope}): losses differ {runs}"
        ratio = round(fused["peak_mb"] / max(plain["peak_mb"], 1e-9), 3)
        out[scope] = {**runs, "fused_over_plain": ratio}
        what = "loss step (head + loss)" if scope == "loss" else "whole step (LoRA model)"
        print(f"memory, {what}, {args.memory_seq} tokens, last 128 labelled: plain "
              f"{plain['peak_mb']} MB, fused {fused['peak_mb']} MB ({ratio}x)")  # fmt: skip
    return out


# ---------------------------------------------------------------------------- comparison


def rate(run: dict[str, Any], warmup: int) -> float:
    tokens, times = run["tokens"], run["times"]
    return (tokens[-1] - tokens[warmup - 1]) / (times[-1] - times[warmup - 1])


def compare(name: str, ftune: dict[str, Any], other: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Ratio of ftune's tokens/s to ``other``'s, only if both saw the same tokens per step
    and logged the same losses."""
    per_step = [b - a for a, b in zip([0, *ftune["tokens"]], ftune["tokens"], strict=False)]
    other_step = [b - a for a, b in zip([0, *other["tokens"]], other["tokens"], strict=False)]
    row: dict[str, Any] = {
        "baseline": name,
        "ftune_tokens_per_second": round(rate(ftune, warmup), 1),
        "baseline_tokens_per_second": round(rate(other, warmup), 1),
        "tokens_per_step": round(sum(per_step) / len(per_step), 1),
        "lm_head": ftune.get("lm_head"),
    }
    if per_step != other_step:
        row["mismatch"] = f"tokens per step differ: {per_step[:5]}... vs {other_step[:5]}..."
        return row
    worst = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(ftune["losses"], other["losses"],
                                                               strict=True))
    row["max_rel_loss_diff"] = float(f"{worst:.2e}")
    if worst > 1e-3:
        row["mismatch"] = f"losses differ (max relative difference {worst:.2e})"
        return row
    row["ratio"] = round(row["ftune_tokens_per_second"] / row["baseline_tokens_per_second"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="sft,chat,dpo,memory")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each trainer, alternating order; the fastest is kept (on a "
                         "shared machine, load from others only ever slows a run down)")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--memory-seq", type=int, default=2048)
    ap.add_argument("--gpu", action="store_true", help="runtime.device cuda")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scope", default="step", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        job = Path(args.job)
        if args.worker == "plain":
            out = worker_plain(job)
        elif args.worker == "trl":
            out = worker_trl(job)
        else:
            out = worker_memory(job, args.fused, args.scope, args.memory_seq, 128)
        print(json.dumps(out))
        return

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ftune-bench-plain-") as tmp:
        root = Path(tmp)
        model = build_model(root / "model", args)
        for case in cases:
            if case == "memory":
                job = write_job(root, "sft", model, root / "sft.jsonl", args)
                results["memory"] = measure_memory(job, args)
                continue
            data = write_jsonl(root / f"{case}.jsonl", rows_for(case, args.rows))
            job = write_job(root, case, model, data, args)
            baselines = ["trl"] if case == "dpo" else ["plain", "trl"] if case == "sft" else ["plain"]
            kinds = ["ftune", *baselines]
            best: dict[str, dict[str, Any]] = {}
            for i in range(args.repeats):  # alternating order; the fastest run of each kept
                for kind in kinds if i % 2 == 0 else kinds[::-1]:
                    run = run_ftune(job, args.threads) if kind == "ftune" else run_worker(
                        kind, job, args.threads)
                    if kind not in best or rate(run, args.warmup) > rate(best[kind], args.warmup):
                        best[kind] = run
            ours = best["ftune"]
            rows = []
            for kind in baselines:
                other = best[kind]
                label = {"plain": "transformers Trainer", "trl": "TRL " + (
                    "DPOTrainer" if case == "dpo" else "SFTTrainer")}[kind]
                rows.append(compare(label, ours, other, args.warmup))
            results[case] = rows
            for r in rows:
                verdict = f"{r['ratio']}x" if "ratio" in r else f"NO RATIO: {r['mismatch']}"
                print(f"{case}: ftune {r['ftune_tokens_per_second']} tok/s vs {r['baseline']} "
                      f"{r['baseline_tokens_per_second']} tok/s -> {verdict} "
                      f"({r['tokens_per_step']} tokens/step, lm_head {r['lm_head']})")  # fmt: skip

    print()
    write_record(f"trainer-vs-plain-{'gpu' if args.gpu else 'cpu'}", results, args=args)


if __name__ == "__main__":
    main()
