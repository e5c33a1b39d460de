"""Service overhead: the same training run through the service vs launched directly.

    python -m bench.service_overhead [--steps 300] [--repeat 3] [--timeline] [--processes 1]

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
import tempfile
import time
from datetime import datetime
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from bench.record import write_record
from core.run.plan import RunPlan

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


def _unix(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def trainer_marks(events: list[dict]) -> dict[str, float]:
    """When the trainer reached each point, from its own events (rank 0)."""
    marks: dict[str, float] = {}
    if events:
        marks["trainer_first_event"] = float(events[0]["time"])  # its imports are done
    steps = [e for e in events if e.get("type") == "progress"]
    for e in events:
        if e.get("type") == "started" and "training_started" not in marks:
            marks["training_started"] = float(e["time"])
        if e.get("type") == "finished":
            marks["trainer_finished_event"] = float(e["time"])  # the adapter is published
    if steps:
        marks["first_step"] = float(steps[0]["time"])
        marks["last_step"] = float(steps[-1]["time"])
    return marks


def worker_marks(log_path: Path, job_id: str) -> dict[str, float]:
    """When the worker claimed, launched and saw the trainer exit (its JSON log lines)."""
    marks: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if job_id not in line or not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        msg = str(rec.get("message", ""))
        for key, needle in (("claimed_log", ": claimed attempt"), ("launched", ": launched pid"),
                            ("trainer_exited", ": trainer exited")):
            if needle in msg and key not in marks:
                marks[key] = _unix(rec["time"])
    return marks


# Stages of a run, in order: (name, from mark, to mark). A stage whose marks are missing
# (the direct run has no claim or worker) is left out of that run's row.
STAGES = [
    ("POST -> claimed (running)", "post", "claimed"),
    ("claimed -> launched (prepare, spawn)", "claimed", "launched"),
    ("launched -> trainer's first event (imports)", "launched", "trainer_first_event"),
    ("first event -> training started (data, model)", "trainer_first_event", "training_started"),
    ("training started -> first step", "training_started", "first_step"),
    ("first step -> last step", "first_step", "last_step"),
    ("last step -> finished event (save)", "last_step", "trainer_finished_event"),
    ("finished event -> trainer exited", "trainer_finished_event", "trainer_exited"),
    ("trainer exited -> succeeded (verdict)", "trainer_exited", "succeeded"),
    ("succeeded -> client saw it (polling)", "succeeded", "client_saw"),
]


def stage_seconds(marks: dict[str, float]) -> dict[str, float]:
    return {name: marks[b] - marks[a] for name, a, b in STAGES if a in marks and b in marks}


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(own, reaped children's) user+system CPU seconds of a live process."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system, t.children_user + t.children_system


def run_service(client, spec: dict, stack) -> dict:
    api_pid, worker_pid = (p.pid for p in stack.procs[:2])
    api0, (worker0, tree0) = cpu_seconds(api_pid)[0], cpu_seconds(worker_pid)
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
    api1, (worker1, tree1) = cpu_seconds(api_pid)[0], cpu_seconds(worker_pid)
    if job["status"] != "succeeded":
        raise SystemExit(f"service job {job['status']}: {job.get('error')}")
    job_dir = Path(client.launch(job["id"])["argv"][-1])
    events = read_events(job_dir / "events.jsonl")
    first = first_step_time(events)
    marks = {"post": t0, "claimed": _unix(job["started_at"]),
             "succeeded": _unix(job["finished_at"]), "client_saw": t1,
             **worker_marks(stack.logs_dir / "worker0.log", job["id"]), **trainer_marks(events)}
    return {
        "job_id": job["id"],
        "job_dir": str(job_dir),
        "wall_seconds": t1 - t0,
        "dispatch_seconds": (running_at or t1) - t0,
        "post_to_first_step_seconds": (first - t0) if first else None,
        "load_seconds": load_seconds(events),
        "stages": stage_seconds(marks),
        "api_cpu_seconds": api1 - api0,
        "worker_cpu_seconds": worker1 - worker0,
        "trainer_cpu_seconds": tree1 - tree0,
    }


def run_direct(service_job_dir: Path, launch: dict, work: Path) -> dict:
    """Re-run the same job dir by hand, exactly as docs/architecture.md says one can."""
    job_dir = work / f"direct-{time.time_ns()}"
    job_dir.mkdir(parents=True)
    shutil.copy(service_job_dir / "accelerate.yaml", job_dir / "accelerate.yaml")
    plan = RunPlan.read(service_job_dir / "spec.json")
    fresh = plan.runtime.model_copy(update={"resume_from_checkpoint": None})
    plan.model_copy(update={"runtime": fresh}).write(job_dir / "spec.json")
    argv = [a.replace(str(service_job_dir), str(job_dir)) for a in launch["argv"]]
    env = {**os.environ, **launch.get("env", {}), "PYTHONPATH": str(REPO)}
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    with open(job_dir / "trainer.log", "wb") as log:
        rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            check=False).returncode
    t1 = time.time()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise SystemExit(f"direct run failed ({rc}); see {job_dir / 'trainer.log'}")
    events = read_events(job_dir / "events.jsonl")
    first = first_step_time(events)
    marks = {"launched": t0, "trainer_exited": t1, **trainer_marks(events)}
    return {
        "wall_seconds": t1 - t0,
        "launch_to_first_step_seconds": (first - t0) if first else None,
        "load_seconds": load_seconds(events),
        "stages": stage_seconds(marks),
        "trainer_cpu_seconds": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
    }


def print_timeline(rows: list[dict], title: str) -> dict[str, dict[str, float]]:
    """Median seconds per stage, service beside direct; returns them."""
    out: dict[str, dict[str, float]] = {}
    print(f"\n{title}")
    print(f"{'stage':<50}{'service':>9}{'direct':>9}{'diff':>9}")
    for name, _, _ in STAGES:
        svc = [r["service"]["stages"][name] for r in rows if name in r["service"]["stages"]]
        dct = [r["direct"]["stages"][name] for r in rows if name in r["direct"]["stages"]]
        s_med = median(svc) if svc else None
        d_med = median(dct) if dct else None
        out[name] = {k: v for k, v in (("service", s_med), ("direct", d_med)) if v is not None}
        diff = (s_med or 0.0) - (d_med or 0.0)
        fmt = lambda v: f"{v:>9.3f}" if v is not None else f"{'-':>9}"
        print(f"{name:<50}{fmt(s_med)}{fmt(d_med)}{diff:>+9.3f}")
    svc_wall = median(r["service"]["wall_seconds"] for r in rows)
    dct_wall = median(r["direct"]["wall_seconds"] for r in rows)
    print(f"{'whole job (client clock / launcher exit)':<50}{svc_wall:>9.3f}{dct_wall:>9.3f}"
          f"{svc_wall - dct_wall:>+9.3f}")
    return out


def wait_for_worker(stack, timeout: float = 300.0) -> None:
    """`ftune up` is ready when its API is; the worker may still be importing the job path.
    The first job would then time the worker's start, not the service."""
    log = stack.logs_dir / "worker0.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "ftune worker ready" in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise SystemExit(f"the worker did not become ready in {timeout:.0f} s; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--processes", type=int, default=1, help="2 = DDP on CPU")
    ap.add_argument("--database-url")
    ap.add_argument("--broker-url")
    ap.add_argument("--timeline", action="store_true", help="print every run's timeline")
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
        wait_for_worker(stack)
        for i in range(args.repeat):
            s = run_service(client, spec, stack)
            launch = client.launch(s["job_id"])
            d = run_direct(Path(s["job_dir"]), launch, work)
            rows.append({"service": s, "direct": d, "ratio": s["wall_seconds"] / d["wall_seconds"]})
            print(f"run {i + 1}: service {s['wall_seconds']:.2f} s, direct {d['wall_seconds']:.2f} s,"
                  f" ratio {rows[-1]['ratio']:.3f}, difference {s['wall_seconds'] - d['wall_seconds']:+.2f} s;"
                  f" CPU s: api {s['api_cpu_seconds']:.2f}, worker {s['worker_cpu_seconds']:.2f},"
                  f" trainer {s['trainer_cpu_seconds']:.2f} (direct {d['trainer_cpu_seconds']:.2f})",
                  flush=True)
            if args.timeline:
                print_timeline(rows[-1:], f"run {i + 1} timeline (seconds)")

    svc = [r["service"] for r in rows]
    summary = {
        "steps": args.steps,
        "processes": args.processes,
        "repeat": args.repeat,
        "service_wall_seconds_median": median(s["wall_seconds"] for s in svc),
        "direct_wall_seconds_median": median(r["direct"]["wall_seconds"] for r in rows),
        "ratio_median": median(r["ratio"] for r in rows),
        "difference_seconds_median": median(
            r["service"]["wall_seconds"] - r["direct"]["wall_seconds"] for r in rows),
        "api_cpu_seconds_median": median(s["api_cpu_seconds"] for s in svc),
        "worker_cpu_seconds_median": median(s["worker_cpu_seconds"] for s in svc),
        "trainer_cpu_seconds_service_median": median(s["trainer_cpu_seconds"] for s in svc),
        "trainer_cpu_seconds_direct_median": median(
            r["direct"]["trainer_cpu_seconds"] for r in rows),
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
    summary["timeline_median"] = print_timeline(rows, f"timeline, median of {len(rows)} (seconds)")
    print()
    print(f"{'figure':<52}{'value':>10}")
    for k, v in summary.items():
        if k not in ("runs", "timeline_median"):
            print(f"{k:<52}{v:>10.3f}" if isinstance(v, float) else f"{k:<52}{v:>10}")
    print()
    write_record("service_overhead", summary, args=args, path=args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
