"""API latency under concurrent clients, on loopback.

Starts the API (uvicorn, one process, as `ftune api` runs it) on a scratch SQLite database,
or on a scratch database created on the PostgreSQL server of --database-url; seeds N jobs;
then 1) one client, then C client threads poll GET /v1/jobs/{id} for S seconds, 2) M jobs are submitted by C
threads at once (the broker is kombu's filesystem transport under the temp dir: nothing
consumes it, it only records each enqueue, which is checked). Prints p50/p99/max and req/s.

    python bench/api_latency.py
    python bench/api_latency.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import json
import random
import ssl
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, insert, select
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.apiserver import RunningApi, running_api
from core.db.models import Job, JobEvent, Tenant, new_id, utcnow

SPEC = {
    "model": {"name_or_path": "org/tiny-model"},
    "dataset": {"file_id": "file-seeded", "format": "text"},
    "training": {"max_steps": 100},
}


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
            {"job_id": job_id, "type": "progress", "message": f"step {k}", "data": {"step": k},
             "created_at": now}
            for job_id in ids for k in range(5)
        ]  # fmt: skip
        s.execute(insert(JobEvent), events)
        s.commit()
    engine.dispose()
    return ids


def run_clients(
    api: RunningApi,
    clients: int,
    work: Callable[[httpx.Client, Result], bool],
    on_start: Callable[[], None] = lambda: None,
) -> Result:
    """``clients`` threads, each with its own keep-alive connection, calling ``work`` until it
    returns False; one merged Result. ``on_start`` runs once all are connected, just before
    they are let go."""
    results = [Result() for _ in range(clients)]
    barrier = threading.Barrier(clients + 1, action=on_start)
    headers = {"Authorization": f"Bearer {api.key}"}
    # One TLS context for all (plain HTTP needs none, but httpx builds one per client, which
    # is slow enough that early connections idle past uvicorn's 5 s keep-alive).
    tls = ssl.create_default_context()

    def loop(result: Result) -> None:
        with httpx.Client(base_url=api.url, headers=headers, timeout=30, verify=tls) as client:
            client.get("/healthz")  # connect before the clock starts
            barrier.wait()
            while work(client, result):
                pass

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


def poll(api: RunningApi, job_ids: list[str], clients: int, seconds: float) -> Result:
    deadline = [float("inf")]

    def start() -> None:
        deadline[0] = time.monotonic() + seconds

    def work(client: httpx.Client, result: Result) -> bool:
        job_id = random.choice(job_ids)
        timed(result, lambda: client.get(f"/v1/jobs/{job_id}"))
        return time.monotonic() < deadline[0]

    return run_clients(api, clients, work, start)


def submit(api: RunningApi, jobs: int, clients: int) -> Result:
    headers = {"Authorization": f"Bearer {api.key}"}
    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(64)).encode()
    with httpx.Client(base_url=api.url, headers=headers, timeout=30) as c:
        r = c.post("/v1/files", files={"file": ("bench.jsonl", rows)})
        r.raise_for_status()
        body = {**SPEC, "dataset": {"file_id": r.json()["id"], "format": "text"}}
    left = iter(range(jobs))
    lock = threading.Lock()

    def work(client: httpx.Client, result: Result) -> bool:
        with lock:
            if next(left, None) is None:
                return False
        timed(result, lambda: client.post("/v1/jobs", json=body))
        return True

    return run_clients(api, clients, work)


def broker_messages(api: RunningApi) -> int:
    folder = api.data_dir / "broker" / "messages"
    return sum(1 for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=None, help="a PostgreSQL server (a scratch "
                        "database is created on it and dropped); default SQLite")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=500, help="jobs seeded (N)")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0, help="polling time, at most 60")
    parser.add_argument("--submit", type=int, default=300, help="jobs submitted (M)")
    parser.add_argument("--log-level", default="INFO", help="the API's (INFO: a line a request)")
    args = parser.parse_args()
    seconds = min(args.seconds, 60.0)
    submits = min(args.submit, 5000)

    with running_api(args.database_url, log_level=args.log_level) as api:
        backend = api.database_url.split(":", 1)[0]
        print(f"API {api.url}: {backend}, 1 uvicorn process, log level {args.log_level}")
        job_ids = seed_jobs(api, args.jobs)
        print(f"seeded {len(job_ids)} jobs")
        alone = poll(api, job_ids, 1, 2.0)
        print(alone.line("GET /v1/jobs/{id}, 1 client for 2 s (unloaded)"))
        polled = poll(api, job_ids, args.clients, seconds)
        print(polled.line(f"GET /v1/jobs/{{id}}, {args.clients} clients for {seconds:.0f} s"))
        submitted = submit(api, submits, args.clients)
        print(submitted.line(f"POST /v1/jobs, {submits} jobs by {args.clients} clients"))
        created = submitted.statuses.get(201, 0)
        messages = broker_messages(api)
        print(f"broker: {messages} messages recorded for {created} jobs created")
        failed = polled.statuses.keys() - {200} or submitted.statuses.keys() - {201}
        tracebacks = api.log_path.read_text().count("Traceback")
        if tracebacks:
            print(f"the API logged {tracebacks} tracebacks: {api.log_path}")
    ok = not failed and not polled.errors and not submitted.errors and messages == created
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
