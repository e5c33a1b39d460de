"""Service overhead: the same training run through the service vs launched directly.

    python bench/service_overhead.py [--steps 300] [--repeat 2] [--processes 1]

For one tiny model, dataset and step count it measures
  * service wall time: POST /v1/jobs -> status succeeded (client clock, polling every 0.1 s)
  * direct wall time: `accelerate launch ... -m core.train <copy of the job dir>` -> exit
  * their ratio (target: under 1.05 for a job of about a minute)
  * POST -> first training step, minus the model load time (the trainer's "load" phase)
  * dispatch latency: POST -> status running with an idle worker
and writes the figures to bench/results/service_overhead.json. Embedded stack (SQLite and
the filesystem broker) unless --database-url / --broker-url are given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.record import write_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def first_step_time(events: list[dict]) -> float | None:
    for e in events:
        if e.get("type") == "progress" and (e.get("step") or 0) >= 1:
            return float(e["time"])
    return None


def load_seconds(events: list[dict]) -> float:
    loads = [e.get("seconds", 0.0) for e in events if e.get("type") == "memory"
             and e.get("phase") == "load" and e.get("rank", 0) == 0]
    return float(loads[0]) if loads else 0.0


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_service(client, spec: dict) -> dict:
    t0 = time.time()
    job = client.create_job(spec)
    running_at = None
    while True:
        job = client.get_job(job["id"])
        if running_at is None and job["status"] != "queued":
            running_at = time.time()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.1)
    t1 = time.time()
    if job["status"] != "succeeded":
        raise SystemExit(f"service job {job['status']}: {job.get('error')}")
    job_dir = Path(client.launch(job["id"])["argv"][-1])
    events = read_events(job_dir / "events.jsonl")
    first = first_step_time(events)
    return {
        "job_id": job["id"],
        "job_dir": str(job_dir),
        "wall_seconds": t1 - t0,
        "dispatch_seconds": (running_at or t1) - t0,
        "post_to_first_step_seconds": (first - t0) if first else None,
        "load_seconds": load_seconds(events),
    }


def run_direct(service_job_dir: Path, launch: dict, work: Path) -> dict:
    """Re-run the same job dir by hand, exactly as the README says one can."""
    job_dir = work / f"direct-{time.time_ns()}"
    job_dir.mkdir(parents=True)
    for name in ("spec.json", "accelerate.yaml"):
        shutil.copy(service_job_dir / name, job_dir / name)
    spec = json.loads((job_dir / "spec.json").read_text())
    spec["runtime"]["resume_from_checkpoint"] = None
    (job_dir / "spec.json").write_text(json.dumps(spec))
    argv = [a.replace(str(service_job_dir), str(job_dir)) for a in launch["argv"]]
    env = {**os.environ, **launch.get("env", {}), "PYTHONPATH": str(REPO)}
    t0 = time.time()
    with open(job_dir / "trainer.log", "wb") as log:
        rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            check=False).returncode
    t1 = time.time()
    if rc != 0:
        raise SystemExit(f"direct run failed ({rc}); see {job_dir / 'trainer.log'}")
    events = read_events(job_dir / "events.jsonl")
    first = first_step_time(events)
    return {
        "wall_seconds": t1 - t0,
        "launch_to_first_step_seconds": (first - t0) if first else None,
        "load_seconds": load_seconds(events),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--processes", type=int, default=1, help="2 = DDP on CPU")
    ap.add_argument("--database-url")
    ap.add_argument("--broker-url")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "service_overhead.json")
    args = ap.parse_args()

    from cli.demo_assets import build_causal_lm, text_rows, write_jsonl
    from cli.embedded import EmbeddedStack
    from client import FtuneClient

    work = Path(tempfile.mkdtemp(prefix="ftune-bench-"))
    model = build_causal_lm(work / "models" / "tiny-llama")
    data = write_jsonl(work / "train.jsonl", text_rows(512))
    spec: dict[str, Any] = {
        "model": {"name_or_path": str(model)},
        "dataset": {"format": "text", "max_seq_length": 64},
        "peft": {"method": "lora", "r": 8, "target_modules": "all-linear"},
        "training": {"max_steps": args.steps, "per_device_train_batch_size": 8,
                     "logging_steps": 10, "save_steps": max(1, args.steps // 2),
                     "learning_rate": 1e-3},
    }
    if args.processes > 1:
        spec["distributed"] = {"strategy": "ddp", "num_processes": args.processes}
    env = {"FTUNE_ALLOWED_MODEL_ROOTS": str(work / "models")}
    if args.database_url:
        env["DATABASE_URL"] = args.database_url
    if args.broker_url:
        env["BROKER_URL"] = args.broker_url
    rows = []
    with EmbeddedStack(data_dir=work / "service", env_overrides=env) as stack, FtuneClient(
        stack.url, stack.api_key
    ) as client:
        spec["dataset"]["file_id"] = client.upload_file(data)["id"]
        for i in range(args.repeat):
            s = run_service(client, spec)
            launch = client.launch(s["job_id"])
            d = run_direct(Path(s["job_dir"]), launch, work)
            rows.append({"service": s, "direct": d, "ratio": s["wall_seconds"] / d["wall_seconds"]})
            print(f"run {i + 1}: service {s['wall_seconds']:.2f} s, direct {d['wall_seconds']:.2f} s,"
                  f" ratio {rows[-1]['ratio']:.3f}", flush=True)

    svc = [r["service"] for r in rows]
    summary = {
        "steps": args.steps,
        "processes": args.processes,
        "repeat": args.repeat,
        "service_wall_seconds_median": median(s["wall_seconds"] for s in svc),
        "direct_wall_seconds_median": median(r["direct"]["wall_seconds"] for r in rows),
        "ratio_median": median(r["ratio"] for r in rows),
        "dispatch_seconds_median": median(s["dispatch_seconds"] for s in svc),
        "post_to_first_step_seconds_median": median(
            s["post_to_first_step_seconds"] for s in svc if s["post_to_first_step_seconds"]),
        "post_to_first_step_minus_load_seconds_median": median(
            s["post_to_first_step_seconds"] - s["load_seconds"] for s in svc
            if s["post_to_first_step_seconds"]),
        "direct_launch_to_first_step_minus_load_seconds_median": median(
            r["direct"]["launch_to_first_step_seconds"] - r["direct"]["load_seconds"]
            for r in rows if r["direct"]["launch_to_first_step_seconds"]),
        "runs": rows,
    }
    print()
    print(f"{'figure':<52}{'value':>10}")
    for k, v in summary.items():
        if k != "runs":
            print(f"{k:<52}{v:>10.3f}" if isinstance(v, float) else f"{k:<52}{v:>10}")
    print()
    write_record("service_overhead", summary, args=args, path=args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
