"""API latency and throughput under dashboard load, measured with wrk on loopback.

Starts the API as `ftune up` runs it (uvicorn serving api.main:app, one process, JSON request
log at INFO) on a scratch SQLite database, or on a scratch database created on the PostgreSQL
server of --database-url; seeds N jobs with events; then, with wrk (pinned to its own CPU so
the load generator does not eat the server's), each for S seconds at C connections:

    /healthz                     the server's floor: no auth, no database
    GET /v1/jobs/{id}            random seeded jobs
    GET /v1/jobs?limit=20        a page of the list
    GET /v1/jobs/{id}/events     a page of events
    GET /v1/jobs/{id}, 1 connection

While they run, a writer plays a running job's monitor (progress update + event, W times a
second, in its own transactions), as the worker does beside the API. Prints req/s and
p50/p99 of each, and GET job's rate as a share of /healthz's in the same run: that ratio
holds on a noisy machine where absolute figures do not. With --runs R every phase runs R
times and medians are printed. Then M jobs are submitted by C client threads at once (the
broker is kombu's filesystem transport under the temp dir: nothing consumes it, it only
records each enqueue, which is checked).

    python -m bench.api_latency
    python -m bench.api_latency --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test

--ftune-up measures GET job through the embedded stack instead, while real tiny jobs start
and run (bench/api_latency_ftune_up.py). One wrk run is bench/wrk.py; what /proc says about
the server meanwhile, bench/procstat.py.

    python -m bench.api_latency --ftune-up --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Self

import httpx
from sqlalchemy import create_engine, insert, select, update
from sqlalchemy.orm import Session

from bench.api_latency_ftune_up import ftune_up
from bench.apiserver import RunningApi, running_api
from bench.record import write_record
from bench.wrk import Phase, median_phase, wrk
from core.db.models import Job, JobEvent, Tenant, new_id, utcnow

SPEC = {
    "model": {"name_or_path": "org/tiny-model"},
    "dataset": {"file_id": "file-seeded", "format": "text"},
    "training": {"max_steps": 100},
}
EVENTS_PER_JOB = 20


def seed_jobs(api: RunningApi, n: int) -> list[str]:
    """N jobs of the key's tenant, straight into the database, in a mix of states."""
    engine = create_engine(api.database_url)
    ids = [new_id("job") for _ in range(n)]
    statuses = ["queued", "running", "succeeded", "failed"]
    with Session(engine) as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "default"))
        now = utcnow()
        rows = [
            {"id": job_id, "tenant_id": tenant_id, "status": statuses[i % 4], "spec": SPEC,
             "created_at": now, "queued_at": now, "step": 40, "total_steps": 100,
             "train_loss": 1.5, "tokens_per_second": 1000.0, "attempt": 1}
            for i, job_id in enumerate(ids)
        ]  # fmt: skip
        s.execute(insert(Job), rows)
        events = [
            {"job_id": job_id, "type": "progress", "message": f"step {k}",
             "data": {"step": k, "loss": 1.5}, "created_at": now}
            for job_id in ids for k in range(EVENTS_PER_JOB)
        ]  # fmt: skip
        s.execute(insert(JobEvent), events)
        s.commit()
    engine.dispose()
    return ids


class MonitorWriter:
    """Writes like a running job's monitor: progress on the job row and an event, each in
    its own transaction, ``per_second`` times a second, until stopped."""

    def __init__(self, database_url: str, job_id: str, per_second: float) -> None:
        self.engine = create_engine(database_url, connect_args=_connect_args(database_url))
        self.job_id = job_id
        self.interval = 1.0 / per_second if per_second > 0 else 0.0
        self.writes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        if self.interval:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.engine.dispose()

    def _run(self) -> None:
        step = 0
        while not self._stop.wait(self.interval):
            step += 1
            with Session(self.engine) as s:
                s.execute(update(Job).where(Job.id == self.job_id).values(step=step % 100))
                s.execute(insert(JobEvent).values(
                    job_id=self.job_id, type="progress", message=f"step {step}",
                    data={"step": step}, created_at=utcnow(),
                ))  # fmt: skip
                s.commit()
            self.writes += 1


def _connect_args(url: str) -> dict[str, object]:
    return {"timeout": 30} if url.startswith("sqlite") else {}


# --------------------------------------------------------------------------- submit (httpx)


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)  # seconds
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    elapsed: float = 0.0

    def line(self, what: str) -> str:
        n = len(self.latencies)
        if not n:
            return f"{what}: no request completed; errors {dict(self.errors)}"
        ms = sorted(x * 1000 for x in self.latencies)
        p50 = statistics.median(ms)
        p99 = ms[min(n - 1, round(0.99 * (n - 1)))]
        bad = sum(c for s, c in self.statuses.items() if s >= 400) + sum(self.errors.values())
        return (
            f"{what}: {n} requests in {self.elapsed:.1f} s = {n / self.elapsed:.0f} req/s; "
            f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms; "
            f"statuses {dict(sorted(self.statuses.items()))}; failed {bad}"
            + (f" {dict(self.errors)}" if self.errors else "")
        )


def submit(api: RunningApi, jobs: int, clients: int) -> Result:
    """``jobs`` POST /v1/jobs by ``clients`` threads, each with its own connection."""
    headers = {"Authorization": f"Bearer {api.key}"}
    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(64)).encode()
    with httpx.Client(base_url=api.url, headers=headers, timeout=30) as c:
        uploaded = c.post("/v1/files", files={"file": ("bench.jsonl", rows)})
        uploaded.raise_for_status()
        body = {**SPEC, "dataset": {"file_id": uploaded.json()["id"], "format": "text"}}
    left = iter(range(jobs))
    lock = threading.Lock()
    results = [Result() for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    # One TLS context for all (plain HTTP needs none, but httpx builds one per client, which
    # is slow enough that early connections idle past uvicorn's 5 s keep-alive).
    tls = ssl.create_default_context()

    def loop(result: Result) -> None:
        with httpx.Client(base_url=api.url, headers=headers, timeout=30, verify=tls) as client:
            client.get("/healthz")  # connect before the clock starts
            barrier.wait()
            while True:
                with lock:
                    if next(left, None) is None:
                        return
                timed(result, lambda: client.post("/v1/jobs", json=body))

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in results]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    merged = Result(elapsed=time.perf_counter() - start)
    for r in results:
        merged.latencies += r.latencies
        merged.statuses.update(r.statuses)
        merged.errors.update(r.errors)
    return merged


def timed(result: Result, call: Callable[[], httpx.Response]) -> None:
    t0 = time.perf_counter()
    try:
        status = call().status_code
    except httpx.HTTPError as e:
        result.errors[type(e).__name__] += 1
        return
    result.latencies.append(time.perf_counter() - t0)
    result.statuses[status] += 1


def broker_messages(api: RunningApi) -> int:
    folder = api.data_dir / "broker" / "messages"
    return sum(1 for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("FTUNE_BENCH_DATABASE_URL"),
                        help="a PostgreSQL server (a scratch database is created on it and "
                        "dropped); default $FTUNE_BENCH_DATABASE_URL, else SQLite")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=500, help="jobs seeded (N)")
    parser.add_argument("--connections", type=int, default=100, help="wrk connections (C)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase (S), at most 60")
    parser.add_argument("--runs", type=int, default=1, help="repeat every phase (R), medians")
    parser.add_argument("--writes-per-second", type=float, default=20.0,
                        help="the simulated monitor's writes (W); 0: none")  # fmt: skip
    parser.add_argument("--submit", type=int, default=300, help="jobs submitted (M); 0: skip")
    parser.add_argument("--log-level", default="INFO", help="the API's (INFO: a line a request)")
    parser.add_argument("--server-cpus", default="0",
                        help="taskset CPUs of the API ('': any); with --ftune-up, the API "
                        "process of the stack (its worker and trainers are not pinned)")  # fmt: skip
    parser.add_argument("--wrk-cpus", default="1", help="taskset CPUs of wrk ('': any)")
    parser.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"],
                        help="the API's event loop (API-alone mode): uvloop to compare with "
                        "what the API ran before (docs/benchmarks.md)")
    parser.add_argument("--ftune-up", action="store_true",
                        help="measure GET job through `ftune up` (API + worker) while real "
                        "tiny jobs start and run, R runs (each printed)")  # fmt: skip
    parser.add_argument("--job-steps", type=int, default=30,
                        help="--ftune-up: training steps of each job")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="--ftune-up: keep the temp dir")
    parser.add_argument("--worker-nice", type=int, default=None,
                        help="--ftune-up: the worker's nice value (0: as before it had one); "
                        "default what `ftune up` sets")  # fmt: skip
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    if args.ftune_up:
        return ftune_up(args)
    seconds = min(args.seconds, 60.0)
    server_cpus = args.server_cpus or None
    wrk_cpus = args.wrk_cpus or None
    conns = args.connections

    with running_api(args.database_url, log_level=args.log_level, cpus=server_cpus,
                     loop=args.loop) as api:
        backend = api.database_url.split(":", 1)[0].split("+", 1)[0]
        print(f"API {api.url}: {backend}, 1 uvicorn process ({args.loop} loop) on CPUs "
              f"{server_cpus or 'any'}, "
              f"log level {args.log_level}; wrk on CPUs {wrk_cpus or 'any'}")  # fmt: skip
        job_ids = seed_jobs(api, args.jobs)
        print(f"seeded {len(job_ids)} jobs, {EVENTS_PER_JOB} events each; monitor writes "
              f"{args.writes_per_second:g}/s during the phases")  # fmt: skip
        phases = [
            ("/healthz", "/healthz", conns),
            ("GET /v1/jobs/{id}", "/v1/jobs/{id}", conns),
            ("GET /v1/jobs?limit=20", "/v1/jobs?limit=20", conns),
            ("GET /v1/jobs/{id}/events", "/v1/jobs/{id}/events", conns),
            ("GET /v1/jobs/{id}, 1 connection", "/v1/jobs/{id}", 1),
        ]
        runs: dict[str, list[Phase]] = {p[0]: [] for p in phases}
        wrk(api, "warm-up", "/v1/jobs/{id}", job_ids, conns, 2, wrk_cpus)
        with MonitorWriter(api.database_url, job_ids[1], args.writes_per_second) as writer:
            for _ in range(max(1, args.runs)):
                for name, template, c in phases:
                    label = name if c == 1 else f"{name}, {c} connections"
                    phase = wrk(api, label, template, job_ids, c, seconds, wrk_cpus)
                    runs[name].append(phase)
                    if args.runs > 1:
                        print("  " + phase.line())
        print(f"monitor writes: {writer.writes}")
        medians = {name: median_phase(r) for name, r in runs.items()}
        for phase in medians.values():
            print(phase.line())
        ratios = [
            job.rate / health.rate
            for job, health in zip(runs["GET /v1/jobs/{id}"], runs["/healthz"], strict=True)
        ]
        ratio = statistics.median(ratios)
        cost = medians["GET /v1/jobs/{id}"].cpu_ms_per_request / max(
            1e-9, medians["/healthz"].cpu_ms_per_request
        )
        print(f"GET job costs {cost:.1f}x the server CPU of /healthz per request")
        print(f"GET job / healthz rate: {ratio:.1%}"
              + (f" (runs: {', '.join(f'{r:.1%}' for r in ratios)})" if len(ratios) > 1 else ""))  # fmt: skip

        ok = all(p.non_2xx == 0 and p.socket_errors == 0 for r in runs.values() for p in r)
        submitted = None
        if args.submit > 0:
            submitted = submit(api, min(args.submit, 5000), conns)
            print(submitted.line(f"POST /v1/jobs, {args.submit} jobs by {conns} clients"))
            created = submitted.statuses.get(201, 0)
            messages = broker_messages(api)
            print(f"broker: {messages} messages recorded for {created} jobs created")
            ok = ok and not submitted.errors and messages == created
            ok = ok and not (submitted.statuses.keys() - {201})
        tracebacks = api.log_path.read_text().count("Traceback")
        if tracebacks:
            print(f"the API logged {tracebacks} tracebacks: {api.log_path}")
            ok = False

    write_record(f"api-latency-{backend}", {
        "phases": {name: [asdict(p) | {"rate": p.rate} for p in r] for name, r in runs.items()},
        "job_over_healthz": ratios,
        "submit": submitted.line("POST /v1/jobs") if submitted else None,
    }, args=args, backend=backend, connections=conns, seconds=seconds)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
