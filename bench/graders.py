"""GRPO's rollouts and graders: how fast answers are generated, what share of a training
step the graders take, and what a sandboxed python grader call costs.

Usage:
    python -m bench.graders                 # CPU: 4-layer 256-hidden Llama, 4 steps each
    python -m bench.graders --steps 8 --completion 64

Builds a Llama offline (random weights, the tests' BPE tokenizer) and 64 chat prompts. For
each grader below it runs a GRPO job as the worker runs one (``python -m core.train
<job_dir>``), batch 64 answers per step (8 prompts x 8 generations), LoRA r=8 all-linear:

* string_check (like), text_similarity (rouge_l, bleu, fuzzy_match), and a multi grader of a
  string_check and a fuzzy_match combined by a formula.

Figures, from each job's events.jsonl:
* rollout tokens/s: answer tokens generated per second of training (generation, grading,
  forward and backward all included: what a GRPO step yields);
* grader share: seconds spent in the grader (its own clock, every call) over the training
  seconds; the target is under 5% for string and similarity graders at batch 64.

Then the python grader sandbox (core/graders/sandbox.py): a cold call (the sandbox started:
bubblewrap, namespaces, a fresh interpreter) and a warm call (the same sandbox), against
the same function called in-process.

Prints a table and writes bench/results/graders-<time>.json. The measured table is in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import llama, llama_shape, run_trainer, write_plan
from bench.record import write_record

SAMPLE = "{{sample.output_text}}"
GRADERS: dict[str, dict[str, Any]] = {
    "string_check": {"type": "string_check", "name": "g", "input": SAMPLE,
                     "reference": "{{item.animal}}", "operation": "like"},
    "rouge_l": {"type": "text_similarity", "name": "g", "input": SAMPLE,
                "reference": "{{item.reference}}", "evaluation_metric": "rouge_l"},
    "bleu": {"type": "text_similarity", "name": "g", "input": SAMPLE,
             "reference": "{{item.reference}}", "evaluation_metric": "bleu"},
    "fuzzy_match": {"type": "text_similarity", "name": "g", "input": SAMPLE,
                    "reference": "{{item.reference}}", "evaluation_metric": "fuzzy_match"},
    "multi": {"type": "multi", "name": "g", "calculate_output": "0.5 * has + 0.5 * near",
              "graders": {
                  "has": {"type": "string_check", "name": "has", "input": SAMPLE,
                          "reference": "{{item.animal}}", "operation": "ilike"},
                  "near": {"type": "text_similarity", "name": "near", "input": SAMPLE,
                           "reference": "{{item.reference}}", "evaluation_metric": "fuzzy_match"},
              }},
}


def grade(sample: dict[str, Any], item: dict[str, Any]) -> float:
    """The python grader the sandbox runs (its source is sent), and the bench calls
    in-process for comparison."""
    words = sample["output_text"].split()
    return min(1.0, sum(w == item["animal"] for w in words) / 3)


# Its annotations stay unevaluated in the sandbox, which has no `typing` import of ours.
PYTHON_SOURCE = "from __future__ import annotations\n" + inspect.getsource(grade)


def build(root: Path, layers: int, hidden: int) -> tuple[Path, Path]:
    from cli.demo_assets import sentences, write_jsonl

    model = llama(root / "model", **llama_shape(hidden, layers, intermediate=hidden * 2,
                                                 heads=4, kv_heads=2))
    rows = [{"messages": [{"role": "user", "content": s}], "animal": "dog",
             "reference": "the dog runs to the big house"} for s in sentences(64, seed=11)]
    return model, write_jsonl(root / "prompts.jsonl", rows)


def run_job(root: Path, model: Path, data: Path, grader: dict[str, Any], steps: int,
            completion: int) -> dict[str, Any]:
    job = root / "job"
    spec = {
        "model": {"name_or_path": str(model)},
        "dataset": {"path": str(data), "format": "chat", "max_seq_length": 128},
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "training": {"objective": "grpo", "max_steps": steps, "learning_rate": 1e-3,
                     "per_device_train_batch_size": 64, "logging_steps": 1,
                     "save_steps": 10_000,
                     "grpo": {"grader": grader, "num_generations": 8,
                              "max_completion_length": completion, "samples_per_log": 0}},
    }
    write_plan(job, spec, model=model, train=data, job_id="bench")
    run = run_trainer(job)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    events = run.events
    progress = [e for e in events if e["type"] == "progress" and "completion_length" in e]
    grader_events = [e for e in events if e["type"] == "grader" and e["phase"] == "train"]
    train_s = progress[-1]["elapsed_seconds"]
    generated = sum(e["completion_length"] * 64 for e in progress)
    grader_s = grader_events[-1]["graders"]["g"]["seconds"]
    return {
        "steps": len(progress),
        "train_seconds": train_s,
        "generated_tokens": generated,
        "rollout_tokens_per_second": generated / train_s,
        "grader_seconds": grader_s,
        "grader_share": grader_s / train_s,
        "grader_calls": grader_events[-1]["graders"]["g"]["calls"],
        "mean_reward": statistics.fmean(e["reward"] for e in progress),
    }


def sandbox_costs(calls: int) -> dict[str, float]:
    from core.graders.sandbox import PythonSandbox, sandbox_refusal

    if sandbox_refusal() is not None:
        return {"unavailable": 1.0}
    sample, item = {"output_text": "the dog sees the dog"}, {"animal": "dog"}
    t0 = time.perf_counter()
    for _ in range(calls):
        grade(sample, item)
    in_process = (time.perf_counter() - t0) / calls
    cold = []
    for _ in range(5):
        with PythonSandbox(PYTHON_SOURCE) as sb:
            t0 = time.perf_counter()
            assert sb.call(sample, item).score is not None
            cold.append(time.perf_counter() - t0)
    with PythonSandbox(PYTHON_SOURCE) as sb:
        sb.call(sample, item)
        t0 = time.perf_counter()
        for _ in range(calls):
            sb.call(sample, item)
        warm = (time.perf_counter() - t0) / calls
    return {"cold_call_ms": statistics.median(cold) * 1e3, "warm_call_ms": warm * 1e3,
            "in_process_call_us": in_process * 1e6, "warm_over_in_process": warm / in_process,
            "batch64_warm_ms": warm * 64 * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--only", default=",".join(GRADERS))
    args = ap.parse_args()

    results: dict[str, Any] = {"args": vars(args), "graders": {}}
    with tempfile.TemporaryDirectory(prefix="ftune-bench-graders-") as tmp:
        root = Path(tmp)
        model, data = build(root, args.layers, args.hidden)
        for name in args.only.split(","):
            results["graders"][name] = run_job(root / name, model, data, GRADERS[name],
                                               args.steps, args.completion)
    results["python_sandbox"] = sandbox_costs(args.calls)

    print(f"{'grader':<14}{'rollout tok/s':>14}{'train s':>9}{'grader s':>10}{'share':>8}"
          f"{'calls':>7}")
    for name, r in results["graders"].items():
        print(f"{name:<14}{r['rollout_tokens_per_second']:>14.0f}{r['train_seconds']:>9.1f}"
              f"{r['grader_seconds']:>10.3f}{r['grader_share']:>8.2%}{r['grader_calls']:>7}")
    sb = results["python_sandbox"]
    if "unavailable" not in sb:
        print(f"python grader: cold call {sb['cold_call_ms']:.0f} ms, warm call "
              f"{sb['warm_call_ms']:.2f} ms ({sb['warm_over_in_process']:.0f}x the in-process "
              f"{sb['in_process_call_us']:.1f} us); 64 warm calls {sb['batch64_warm_ms']:.0f} ms")
    write_record("graders", results, args=args)


if __name__ == "__main__":
    main()
