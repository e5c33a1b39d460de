"""Webhook delivery: how fast the sender empties the outbox, and what the outbox costs a job
move, against baselines from the same run.

1) A local receiver (http.server, threads) on 127.0.0.1. Baseline: N signed-size POSTs sent
   straight with httpx from BATCH threads (no keep-alive, as the sender). Then N outbox
   events are written and one Sender (worker/upkeep/webhook_sender.py) delivers them: deliveries/s
   and the latency from the event's commit to its arrival (p50/p99), as a ratio of the
   baseline's rate.
2) M jobs moved queued -> running -> succeeded through core/jobs/state.py, by a tenant with no
   endpoint, then by one with an endpoint subscribed to both events: ms per move and the
   ratio (the outbox rows are written in the move's transaction).

    python -m bench.webhook_delivery [--events 500] [--moves 200]
    python -m bench.webhook_delivery --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from core.db.migrate import upgrade_head
from core.db.models import Job, JobStatus, Tenant, WebhookEndpoint, utcnow
from core.db.session import make_engine, unit_of_work
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.webhooks import outbox
from worker.upkeep.webhook_sender import BATCH, Sender


class Arrivals:
    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expect = 0


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default 5 resets parallel connects


def start_receiver(arrivals: Arrivals) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            now = time.time()
            with arrivals.lock:
                arrivals.at.setdefault(self.headers.get("webhook-id", str(now)), now)
                if len(arrivals.at) >= arrivals.expect:
                    arrivals.done.set()
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def baseline(url: str, n: int, body: str) -> float:
    """Requests/s of plain POSTs to the receiver from BATCH threads."""
    client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), trust_env=False)
    start = time.perf_counter()
    with ThreadPoolExecutor(BATCH) as pool:
        statuses = list(pool.map(lambda i: client.post(url, content=body, headers={
            "content-type": "application/json", "webhook-id": f"base-{i}"}).status_code,
            range(n)))
    elapsed = time.perf_counter() - start
    client.close()
    assert all(s == 200 for s in statuses)
    return n / elapsed


def tenant_with_endpoint(maker: sessionmaker[Session], url: str | None) -> str:
    with unit_of_work(maker) as s:
        t = Tenant(name=f"bench-{time.monotonic_ns()}")
        s.add(t)
        s.flush()
        if url is not None:
            s.add(WebhookEndpoint(tenant_id=t.id, url=url, secret=outbox.new_secret(),
                                  event_types=["job.running", "job.succeeded"]))
        return t.id


def deliver(maker: sessionmaker[Session], settings: Settings, url: str, n: int,
            arrivals: Arrivals) -> tuple[float, list[float]]:
    tenant = tenant_with_endpoint(maker, url)
    with unit_of_work(maker) as s:
        endpoint = s.query(WebhookEndpoint.id).filter_by(tenant_id=tenant).scalar()
        data = {"object": "job", "id": "job-bench", "status": "succeeded", "pad": "x" * 300}
        for _ in range(n):
            outbox.record(s, tenant, "job.succeeded", data, [endpoint])
    committed = time.time()
    arrivals.at.clear()
    arrivals.expect = n
    arrivals.done.clear()
    stop = threading.Event()
    sender = Sender(maker, settings)
    thread = threading.Thread(target=sender.run, args=(stop,), daemon=True)
    start = time.perf_counter()
    thread.start()
    arrivals.done.wait(600)
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join(30)
    sender.close()
    return n / elapsed, [(t - committed) * 1000 for t in arrivals.at.values()]


def moves_ms(maker: sessionmaker[Session], tenant: str, m: int) -> float:
    """ms per move: queued -> running -> succeeded for m jobs, one transaction per move."""
    ids = []
    with unit_of_work(maker) as s:
        for _ in range(m):
            job = Job(tenant_id=tenant, spec={}, status=JobStatus.queued, queued_at=utcnow())
            s.add(job)
            s.flush()
            ids.append(job.id)
    start = time.perf_counter()
    for job_id in ids:
        with unit_of_work(maker) as s:
            jobstate.claim(s, job_id, worker_id="bench", max_attempts=3, now=utcnow())
        with unit_of_work(maker) as s:
            jobstate.finish(s, job_id, jobstate.Holder("bench", 1), previous=JobStatus.running,
                            to=JobStatus.succeeded, now=utcnow())
    return (time.perf_counter() - start) * 1000 / (2 * m)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--moves", type=int, default=200)
    parser.add_argument("--database-url", default=None,
                        help="a PostgreSQL server: a scratch database is made on it")
    args = parser.parse_args()

    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if args.database_url:
            from testkit.pg import migrated_database

            url = stack.enter_context(migrated_database("ftune_bench", args.database_url))
        else:
            url = f"sqlite:///{tmp / 'ftune.db'}"
            upgrade_head(url)
        engine = make_engine(url)
        maker = sessionmaker(bind=engine, expire_on_commit=False)
        settings = Settings(database_url=url, data_dir=tmp, webhook_allow_http=True,
                            webhook_allowed_networks=["127.0.0.1/32"],
                            webhook_poll_seconds=0.01)
        arrivals = Arrivals()
        server = start_receiver(arrivals)
        hook_url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        body = json.dumps({"id": "x", "type": "job.succeeded", "data": {"pad": "x" * 300}})

        arrivals.expect = args.events
        base = baseline(hook_url, args.events, body)
        rate, latencies = deliver(maker, settings, hook_url, args.events, arrivals)
        print(f"database: {engine.dialect.name}")
        print(f"baseline: {args.events} plain POSTs from {BATCH} threads: {base:.0f} req/s")
        print(f"sender:   {args.events} outbox events delivered: {rate:.0f} deliveries/s "
              f"({rate / base:.2f} x baseline); commit -> arrival p50 "
              f"{statistics.median(latencies):.0f} ms, p99 {pct(latencies, 0.99):.0f} ms")

        quiet = moves_ms(maker, tenant_with_endpoint(maker, None), args.moves)
        hooked = moves_ms(maker, tenant_with_endpoint(maker, hook_url), args.moves)
        print(f"job moves: {quiet:.2f} ms/move with no endpoint, {hooked:.2f} ms/move with one "
              f"subscribed endpoint ({hooked / quiet:.2f} x)")
        server.shutdown()
        engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
