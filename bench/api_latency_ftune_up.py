"""``python -m bench.api_latency --ftune-up``: GET /v1/jobs/{id} through the embedded stack
as `ftune up` runs it, while real tiny training jobs start and run (see ``ftune_up``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.apiserver import RunningApi
from bench.procstat import pin_threads, placement
from bench.record import write_record
from bench.wrk import wait_line, wrk


def ftune_up(args: argparse.Namespace) -> int:
    """GET /v1/jobs/{id} through the embedded stack as `ftune up` runs it (API and worker
    processes, SQLite, filesystem broker) while real tiny training jobs start and run.

    Each run has two phases at C connections: "idle" (no job queued or running: the
    baseline of this run, on this machine's load now) and "job starting" (a LoRA job on a
    tiny Llama is POSTed half a second into the phase: the worker claims it, writes its
    run plan, `accelerate launch` imports torch and trains, the monitor writes its
    progress). A run's p99 over the idle p99 holds on a loaded machine where the absolute
    figures do not."""
    from cli.demo_assets import build_causal_lm, text_rows, write_jsonl
    from cli.embedded import EMBEDDED_WORKER_NICE, EmbeddedStack

    seconds = min(args.seconds, 60.0)
    wrk_cpus = args.wrk_cpus or None
    conns = args.connections
    tmp = Path(tempfile.mkdtemp(prefix="ftune-bench-up-"))
    models = tmp / "models"
    model_dir = build_causal_lm(models / "tiny-llama")
    train = write_jsonl(tmp / "train.jsonl", text_rows(256))
    spec: dict[str, dict[str, Any]] = {
        "model": {"name_or_path": str(model_dir), "task": "causal_lm"},
        "dataset": {"format": "text", "max_seq_length": 64},
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "training": {"max_steps": args.job_steps, "per_device_train_batch_size": 8,
                     "logging_steps": 1, "save_steps": max(1, args.job_steps // 2)},
    }  # fmt: skip
    overrides = {
        "FTUNE_ALLOWED_MODEL_ROOTS": str(models), "HF_HUB_OFFLINE": "1",
        "FTUNE_JOBS_PER_MINUTE_PER_TENANT": "1000000", "FTUNE_LOG_LEVEL": args.log_level,
    }  # fmt: skip
    nice = EMBEDDED_WORKER_NICE if args.worker_nice is None else args.worker_nice
    overrides["FTUNE_WORKER_NICE"] = str(nice)
    stack = EmbeddedStack(data_dir=tmp / "service", env_overrides=overrides)
    rows: list[dict[str, object]] = []
    ok = True
    try:
        with stack, httpx.Client(base_url=stack.url, timeout=30,
                                 headers={"Authorization": f"Bearer {stack.api_key}"}) as c:
            api = RunningApi(stack.url, stack.api_key, "", stack.data_dir,
                             stack.logs_dir / "api.log", stack.procs[0].pid)
            file_id = c.post("/v1/files", files={"file": ("train.jsonl", train.read_bytes())})
            file_id.raise_for_status()
            body = {**spec, "dataset": {**spec["dataset"], "file_id": file_id.json()["id"]}}
            ids: list[str] = []

            def submit_job() -> None:
                r = c.post("/v1/jobs", json=body)
                r.raise_for_status()
                ids.append(r.json()["id"])

            submit_job()  # a first job: ids to GET in the first idle phase, and warm caches
            wait_jobs_done(c, ids, timeout=600)
            print(f"ftune up at {stack.url}: API pid {api.pid}; wrk on CPUs {wrk_cpus or 'any'};"
                  f" {conns} connections, {seconds:g} s a phase; jobs of {args.job_steps} steps")
            worker_pid = stack.procs[1].pid
            if args.server_cpus:
                # As the API-alone mode runs it: off wrk's CPU. Unpinned, the kernel can
                # place the API's loop beside wrk (a wake-up from wrk pulls it to wrk's CPU).
                pin_threads(api.pid, {int(x) for x in args.server_cpus.split(",")})
            print(f"  {placement(api.pid, 'API')}; {placement(worker_pid, 'worker')}")
            wrk(api, "warm-up", "/v1/jobs/{id}", ids, conns, 2, wrk_cpus)
            for run in range(1, max(1, args.runs) + 1):
                locks_before = lock_fallbacks(api.log_path)
                t0 = time.time()
                idle = wrk(api, "idle", "/v1/jobs/{id}", ids, conns, seconds, wrk_cpus,
                           beside_pid=worker_pid)  # fmt: skip
                t1 = time.time()
                locks_idle = lock_fallbacks(api.log_path) - locks_before
                started = wrk(api, "job starting", "/v1/jobs/{id}", ids, conns, seconds,
                              wrk_cpus, during=submit_job, beside_pid=worker_pid)  # fmt: skip
                t2 = time.time()
                locks_start = lock_fallbacks(api.log_path) - locks_before - locks_idle
                inside = [slow_inside(api.log_path, a, b) for a, b in ((t0, t1), (t1, t2))]
                job = c.get(f"/v1/jobs/{ids[-1]}").json()
                print(f"run {run}: GET job p99 {started.p99_ms:.1f} ms with a job starting "
                      f"({started.rate:,.0f} req/s, max {started.max_ms:.1f} ms) vs idle "
                      f"{idle.p99_ms:.1f} ms ({idle.rate:,.0f} req/s): "
                      f"{started.p99_ms / max(idle.p99_ms, 1e-9):.2f}x; job {job['status']} at "
                      f"step {job['progress']['step']} at the phase's end; loop reads that "
                      f"met a lock: {locks_idle} idle, {locks_start} starting")  # fmt: skip
                print(f"  requests >= {SLOW_INSIDE_MS} ms inside the API (its log's "
                      f"duration_ms; stalls in the server, not queueing before it): "
                      f"idle {inside[0][0]} (max {inside[0][1]:.0f} ms), starting "
                      f"{inside[1][0]} (max {inside[1][1]:.0f} ms)")  # fmt: skip
                # Then, if the job is still going, a phase while it trains (every step a
                # burst of CPU on every core the worker gave it, and the monitor's writes).
                running = None
                if wait_training(c, ids[-1], timeout=300):
                    t3 = time.time()
                    running = wrk(api, "job running", "/v1/jobs/{id}", ids, conns, seconds,
                                  wrk_cpus, beside_pid=worker_pid)  # fmt: skip
                    job = c.get(f"/v1/jobs/{ids[-1]}").json()
                    inside.append(slow_inside(api.log_path, t3, time.time()))
                    print(f"  job running: GET job p99 {running.p99_ms:.1f} ms "
                          f"({running.rate:,.0f} req/s, max {running.max_ms:.1f} ms); job "
                          f"{job['status']} at step {job['progress']['step']} at the phase's "
                          f"end; requests >= {SLOW_INSIDE_MS} ms inside the API "
                          f"{inside[2][0]} (max {inside[2][1]:.0f} ms)")  # fmt: skip
                else:
                    print("  job running: not measured (the job was not training any more)")
                phases = [p for p in (idle, started, running) if p is not None]
                for phase in phases:
                    print("  " + wait_line(phase))
                ok = ok and all(p.non_2xx == 0 and p.socket_errors == 0 for p in phases)
                rows.append({"run": run, "idle": asdict(idle) | {"rate": idle.rate},
                             "starting": asdict(started) | {"rate": started.rate},
                             "running": (asdict(running) | {"rate": running.rate}
                                         if running else None),
                             "lock_fallbacks": [locks_idle, locks_start],
                             "slow_inside": inside,
                             "job_status_at_end": job["status"]})  # fmt: skip
                finished = wait_jobs_done(c, ids, timeout=600)
                failed = [j for j in finished if j["status"] != "succeeded"]
                if failed:
                    print(f"jobs not succeeded: {[(j['id'], j['status'], j['error']) for j in failed]}")
                    ok = False
            for key, what in (("idle", "idle"), ("starting", "a job starting"),
                              ("running", "a job running")):
                p99s = [r[key]["p99_ms"] for r in rows if r[key]]  # type: ignore[index]
                if p99s:
                    print(f"GET job p99 with {what}, runs: "
                          f"{', '.join(f'{p:.1f}' for p in p99s)} ms; worst {max(p99s):.1f} ms")
            tracebacks = api.log_path.read_text().count("Traceback")
            if tracebacks:
                print(f"the API logged {tracebacks} tracebacks: {api.log_path}")
                ok = False
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    write_record("api-latency-ftune-up", rows, args=args, connections=conns, seconds=seconds)
    return 0 if ok else 1


def wait_training(c: httpx.Client, job_id: str, timeout: float) -> bool:
    """Until the job has logged a training step (True) or is no longer running (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return False
        if job["status"] == "running" and (job["progress"]["step"] or 0) >= 1:
            return True
        time.sleep(0.5)
    return False


def wait_jobs_done(c: httpx.Client, ids: list[str], timeout: float) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = [c.get(f"/v1/jobs/{i}").json() for i in ids]
        if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs):
            return jobs
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not finished after {timeout} s: {jobs}")
        time.sleep(0.5)


SLOW_INSIDE_MS = 100


def slow_inside(log_path: Path, start: float, end: float) -> tuple[int, float]:
    """Requests the API logged between ``start`` and ``end`` (unix seconds) that took at
    least SLOW_INSIDE_MS from the app's first byte to its response, and the longest: a
    burst of them ending together is a wait shared inside the server (in this bench's
    first runs: every 10 s, the API key's verification, which all requests with the key
    awaited)."""
    from datetime import datetime

    n, longest = 0, 0.0
    for line in log_path.read_text(errors="replace").splitlines():
        if '"duration_ms"' not in line:
            continue
        try:
            rec = json.loads(line)
            at = datetime.fromisoformat(rec["time"]).timestamp()
        except (ValueError, KeyError):
            continue
        if start <= at <= end:
            ms = float(rec["duration_ms"])
            longest = max(longest, ms)
            n += ms >= SLOW_INSIDE_MS
    return n, longest


def lock_fallbacks(log_path: Path) -> int:
    """Reads on the API's event loop that met a SQLite lock (api/deps.py Reader logs each)."""
    return log_path.read_text(errors="replace").count("a read on the event loop met a lock")
