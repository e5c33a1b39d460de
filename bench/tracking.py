"""What experiment tracking costs a job: the same tiny job without trackers and with
TensorBoard + MLflow (SQLite store) + W&B (offline), run as the worker runs it
(`python -m core.train <job_dir>`), alternating, several times.

Usage:
    python -m bench.tracking                      # 3 pairs, 40 steps, a log every step
    python -m bench.tracking --pairs 5 --steps 100 --logging-steps 10

Per job, from its events.jsonl: the training time (the "finished" event's runtime_seconds:
the Trainer's loop, where the per-log cost of the trackers falls) and the whole job's wall
time (process start to exit: also the trackers' start, the adapter upload and their close).
Printed as medians and as ratios tracked / untracked from the same run. logging_steps 1 is
the worst case: every optimizer step sends its metrics to all three trackers.
The MLflow store is created (schema migrated) before the first job, outside the timings.

Measured 2026-11-23 on the shared 2-core CPU dev machine (load ~6-10 from other work; the
tests' tiny Llama, 40 steps, a log every step, 3 pairs): training 1.03 s -> 2.74 s, i.e.
~43 ms per log for all three trackers together (MLflow's SQLite commit, the W&B service,
the event file); whole job 30.0 s -> 39.3 s (1.31x: importing mlflow and wandb, starting
W&B's service, logging the adapter). On a real model a step takes far longer than 43 ms,
and logging_steps is usually 10 or more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import run_trainer, write_plan
from cli.demo_assets import build_causal_lm, text_rows, write_jsonl


def job_dir(root: Path, name: str, model: Path, data: Path, args: argparse.Namespace,
            tracking: dict[str, Any] | None) -> Path:
    job = root / name
    spec: dict[str, Any] = {
        "model": {"name_or_path": str(model)},
        "dataset": {"path": str(data), "format": "text", "max_seq_length": 64},
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0},
        "training": {"max_steps": args.steps, "per_device_train_batch_size": 4,
                     "logging_steps": args.logging_steps, "save_steps": 10**6, "seed": 0},
    }
    if tracking:
        spec["tracking"] = {"report_to": tracking["report_to"]}
    write_plan(job, spec, model=model, train=data, job_id=f"job-{name}", tracking=tracking)
    return job


def run(job: Path) -> dict[str, float]:
    r = run_trainer(job)
    if r.returncode != 0:
        sys.exit(f"{job.name} failed:\n{r.stderr[-3000:]}")
    (finished,) = r.of_type("finished")
    return {"train_s": float(finished["runtime_seconds"]), "wall_s": r.wall_seconds,
            "cpu_s": r.cpu_seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--logging-steps", type=int, default=1)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ftune-bench-tracking-"))
    model = build_causal_lm(root / "model")
    data = write_jsonl(root / "train.jsonl", text_rows(256))
    store = f"sqlite:///{root / 'mlflow.db'}"
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=store).search_experiments()  # creates the schema, untimed

    results: dict[str, list[dict[str, float]]] = {"none": [], "all three": []}
    for i in range(args.pairs):
        for mode, runs in results.items():
            tracking = None
            if mode != "none":
                tracking = {
                    "report_to": ["tensorboard", "mlflow", "wandb"], "run_name": f"b{i}",
                    "tags": {"ftune.job_id": f"job-{mode}-{i}"},
                    "mlflow": {"tracking_uri": store, "experiment_name": "bench",
                               "artifact_location": str(root / "artifacts"), "ui_url": None},
                    "wandb": {"mode": "offline", "project": "bench", "entity": None,
                              "base_url": None},
                }
            name = f"{'tracked' if tracking else 'plain'}-{i}"
            runs.append(run(job_dir(root, name, model, data, args, tracking)))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    print(f"{args.pairs} pairs, {args.steps} steps, a log every {args.logging_steps} step(s)")
    print(f"{'trackers':<10} {'train s (median)':>17} {'job wall s (median)':>20} "
          f"{'job CPU s (median)':>19}")
    for mode in results:
        print(f"{mode:<10} {med(mode, 'train_s'):>17.2f} {med(mode, 'wall_s'):>20.2f} "
              f"{med(mode, 'cpu_s'):>19.2f}")
    print(f"ratio      {med('all three', 'train_s') / med('none', 'train_s'):>17.2f}x"
          f" {med('all three', 'wall_s') / med('none', 'wall_s'):>19.2f}x")
    per_log = (med("all three", "train_s") - med("none", "train_s")) / (
        args.steps / args.logging_steps)
    print(f"added per log (all three trackers): {per_log * 1000:.1f} ms")


if __name__ == "__main__":
    main()
