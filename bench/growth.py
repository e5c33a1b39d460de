"""Does history slow the service? The same requests with a small and a large history.

For each database (SQLite, and a scratch database on the PostgreSQL server of
--database-url) and each size (default 100 and 100,000 jobs): the API starts as `ftune api`
runs it (bench/apiserver.py, pinned to CPU 0), the history is inserted straight into the
database (bench/history_rows.py: jobs of five tenants over two years, 40% of them the key's,
mostly finished with attempts, usage days, events and OpenAI metadata; the same 10 queued
and 5 running jobs at any size; one finished job with as many events as the size has jobs),
then wrk (pinned to CPU 1, one thread) drives each request for --seconds at --connections:

    jobs first page          GET /v1/jobs?limit=20
    jobs deep page           GET /v1/jobs?limit=20&after=<in the oldest tenth: a full page>
    jobs status=running      GET /v1/jobs?status=running&limit=20 (matches 5)
    dashboard list           GET /v1/jobs?limit=50 (what /ui polls)
    job                      GET /v1/jobs/{id}, random jobs of the tenant
    openai first page        GET /v1/fine_tuning/jobs?limit=20
    openai deep page         GET /v1/fine_tuning/jobs?limit=20&after=<oldest tenth>
    openai metadata filter   GET /v1/fine_tuning/jobs?metadata[release]=rc (matches 5)
    usage 31 days            GET /v1/usage?from=<30 days ago>&to=<today>
    events first page        GET /v1/jobs/{big}/events?limit=100
    events deep page         GET /v1/jobs/{big}/events?limit=100&after=<near the end>
    openai events page       GET /v1/fine_tuning/jobs/{big}/events?limit=20
    metrics scrape           GET /metrics, one connection

Prints req/s, p99, max and the API's CPU milliseconds per request of each at both sizes,
the SQL statements one request runs (counted in an app built in this process on the same
database), the load average before and after the requests, and the ratios (rate small /
rate large, and CPU per request large / small: 1.0 = no slowdown; on a shared machine the
CPU per request and the statements hold where rates follow the load), the seconds the
inserts took, and at the large size the seconds the history's migrations take on that
table (0019 alone, then 0015-0019 from 0014: backfills and index builds over the whole
history).

    python -m bench.growth
    python -m bench.growth --backends sqlite --sizes 100 10000 --seconds 2
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
from sqlalchemy import create_engine, func, select, text

from bench.apiserver import RunningApi, running_api
from bench.history_rows import Seeded, seed
from bench.wrk import Phase, median_phase, wrk
from core.db.models import JobEvent, utcnow

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True)
class Request:
    name: str
    template: str  # {id} is replaced by one of ids, at random per request
    ids: list[str]
    connections: int | None = None  # None: --connections


def requests(seeded: Seeded, api: RunningApi, rng: random.Random) -> list[Request]:
    jobs = seeded.job_ids
    # Anchors in the oldest tenth that still have a full page after them (at 100 jobs, the
    # tenant's 40 hold barely two pages: there "deep" is as deep as a full page goes).
    last_full = len(jobs) - 21
    first = max(0, min(int(0.9 * len(jobs)), last_full) - 50)
    anchors = jobs[first:last_full + 1]
    deep = rng.sample(anchors, min(50, len(anchors)))
    some = rng.sample(jobs, min(200, len(jobs)))
    today = utcnow().date()
    engine = create_engine(api.database_url)
    with engine.connect() as c:
        last = c.scalar(select(func.max(JobEvent.id)).where(JobEvent.job_id == seeded.events_job))
    engine.dispose()
    big = seeded.events_job
    usage = f"/v1/usage?from={today - timedelta(days=30)}&to={today}"
    return [
        Request("jobs first page", "/v1/jobs?limit=20", ["-"]),
        Request("jobs deep page", "/v1/jobs?limit=20&after={id}", deep),
        Request("jobs status=running", "/v1/jobs?status=running&limit=20", ["-"]),
        Request("dashboard list", "/v1/jobs?limit=50", ["-"]),
        Request("job", "/v1/jobs/{id}", some),
        Request("openai first page", "/v1/fine_tuning/jobs?limit=20", ["-"]),
        Request("openai deep page", "/v1/fine_tuning/jobs?limit=20&after={id}", deep),
        Request("openai metadata filter",
                "/v1/fine_tuning/jobs?limit=20&metadata%5Brelease%5D=rc", ["-"]),
        Request("usage 31 days", usage, ["-"]),
        Request("events first page", f"/v1/jobs/{big}/events?limit=100", ["-"]),
        Request("events deep page", f"/v1/jobs/{big}/events?limit=100&after={(last or 0) - 150}",
                ["-"]),
        Request("openai events page", f"/v1/fine_tuning/jobs/{big}/events?limit=20", ["-"]),
        Request("metrics scrape", "/metrics", ["-"], connections=1),
    ]


def warm_up(api: RunningApi, r: Request) -> None:
    """A few requests first: the first ones after the inserts read cold pages and parse
    what the process caches (specs, the queue snapshot), which is not what is measured."""
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.key}"},
                      timeout=60) as c:
        for job_id in r.ids[:3]:
            c.get(r.template.replace("{id}", job_id)).raise_for_status()


@contextmanager
def statement_counter(api: RunningApi) -> Iterator[Callable[[Request], float]]:
    """The SQL statements a request runs, counted in an app built in this process on the
    same database (``create_app``, as the server builds it) over a few requests after a
    warm-up: a figure the machine's load does not move, unlike rates and p99."""
    from fastapi.testclient import TestClient
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from api.main import create_app
    from core.infra.settings import Settings

    seen = [0]

    def count(*_: object) -> None:
        seen[0] += 1

    settings = Settings.model_validate({
        "data_dir": api.data_dir, "DATABASE_URL": api.database_url, "BROKER_URL": "filesystem://",
        "jobs_per_minute_per_tenant": 1_000_000})
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {api.key}"

        def per_request(r: Request, n: int = 10) -> float:
            paths = [r.template.replace("{id}", i) for i in (r.ids * n)[:n + 3]]
            for path in paths[:3]:
                client.get(path).raise_for_status()
            event.listen(Engine, "before_cursor_execute", count)
            try:
                seen[0] = 0
                for path in paths[3:]:
                    client.get(path).raise_for_status()
            finally:
                event.remove(Engine, "before_cursor_execute", count)
            return seen[0] / n

        yield per_request


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min)"


def analyze(database_url: str) -> None:
    """PostgreSQL: statistics and the visibility map as autovacuum keeps them on a table
    that grew over time (a bulk insert a second old has neither: every index-only count
    would read the heap). SQLite is measured as `ftune up` runs it: nothing runs ANALYZE."""
    if database_url.startswith("sqlite"):
        return
    engine = create_engine(database_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(text("VACUUM ANALYZE"))
    engine.dispose()


# The migrations of this work, each measured alone on the large history: (the revision
# below it, what it is). Newest first: each is downgraded to its base and upgraded back.
MIGRATIONS = (("0018_job_evaluation", "0019 kept counts"), ("0014_commit_notices", "0015-0019"))


def migration_seconds(database_url: str) -> dict[str, tuple[float, float]]:
    """{what: (downgrade, upgrade to head) seconds} on the history as it stands."""
    from alembic import command

    from core.db.migrate import alembic_config

    cfg = alembic_config(database_url)
    out = {}
    for base, what in MIGRATIONS:
        t0 = time.perf_counter()
        command.downgrade(cfg, base)
        t1 = time.perf_counter()
        command.upgrade(cfg, "head")
        out[what] = (t1 - t0, time.perf_counter() - t1)
    return out


@dataclass
class Run:
    backend: str
    size: int
    seeded: Seeded
    phases: dict[str, Phase]
    statements: dict[str, float] = field(default_factory=dict)  # per request
    migration: dict[str, tuple[float, float]] | None = None
    load: list[str] = field(default_factory=list)  # load averages as the requests ran


def _history(stack: ExitStack, args: argparse.Namespace, backend: str,
             size: int) -> tuple[RunningApi, Seeded]:
    url = args.database_url if backend == "postgresql" else None
    api = stack.enter_context(running_api(url, log_level="WARNING", cpus="0"))
    engine = create_engine(api.database_url)
    seeded = seed(engine, size, size, args.seed)
    engine.dispose()
    analyze(api.database_url)
    print(f"  {backend} {size:,} jobs: inserted {seeded.counts} in {seeded.seconds:.1f} s",
          flush=True)
    return api, seeded


def measure(args: argparse.Namespace, backend: str) -> tuple[Run, Run]:
    """Both histories at once, each behind its own API (pinned to CPU 0; the one not
    measured is idle): each request is measured on the small then the large one, back to
    back, so that what else loads this machine weighs on both alike; with --runs, each
    figure is the median of the runs."""
    rng = random.Random(args.seed)
    with ExitStack() as stack:
        apis = [_history(stack, args, backend, size) for size in args.sizes]
        plans = [requests(seeded, api, rng) for api, seeded in apis]
        phases: list[dict[str, Phase]] = [{}, {}]
        loads = [load_average()]
        print(f"  {loads[0]}", flush=True)
        for batch in zip(*plans, strict=True):
            for i, ((api, _), r) in enumerate(zip(apis, batch, strict=True)):
                warm_up(api, r)
                runs = [wrk(api, r.name, r.template, r.ids, r.connections or args.connections,
                            args.seconds, cpus="1") for _ in range(args.runs)]
                phases[i][r.name] = median_phase(runs)
                print(f"    {args.sizes[i]:>7,}: {phases[i][r.name].line()}", flush=True)
        loads.append(load_average())
        print(f"  {loads[-1]}", flush=True)
        statements: list[dict[str, float]] = []
        for (api, _), plan in zip(apis, plans, strict=True):
            with statement_counter(api) as per_request:
                statements.append({r.name: per_request(r) for r in plan})
        migration = migration_seconds(apis[1][0].database_url)
        for what, (down, up) in migration.items():
            print(f"    migration {what} on {args.sizes[1]:,} jobs: downgrade {down:.1f} s, "
                  f"upgrade {up:.1f} s", flush=True)
        return (Run(backend, args.sizes[0], apis[0][1], phases[0], statements[0], load=loads),
                Run(backend, args.sizes[1], apis[1][1], phases[1], statements[1], migration,
                    loads))


def report(small: Run, large: Run) -> list[str]:
    out = [(f"{small.backend}: {small.size:,} vs {large.size:,} jobs "
            f"(events job: {small.seeded.events:,} vs {large.seeded.events:,} events); "
            f"{' -> '.join(large.load)}"),
           (f"| request | @{small.size:,}: req/s, p99 ms, CPU ms/req, SQL/req | "
            f"@{large.size:,}: req/s, p99 ms, max ms, CPU ms/req, SQL/req | rate ratio | "
            f"CPU ratio |"),
           "|---|---|---|---|---|"]
    for name, a in small.phases.items():
        b = large.phases[name]
        ratio = a.rate / b.rate if b.rate else float("inf")
        cpu = b.cpu_ms_per_request / a.cpu_ms_per_request if a.cpu_ms_per_request else 0.0
        out.append(f"| {name} | {a.rate:,.0f}, {a.p99_ms:.1f}, {a.cpu_ms_per_request:.2f}, "
                   f"{small.statements.get(name, 0):.1f} | "
                   f"{b.rate:,.0f}, {b.p99_ms:.1f}, {b.max_ms:.1f}, "
                   f"{b.cpu_ms_per_request:.2f}, {large.statements.get(name, 0):.1f} | "
                   f"{ratio:.2f} | {cpu:.2f} |")
    for what, (down, up) in (large.migration or {}).items():
        out.append(f"migration {what} with {large.size:,} jobs: upgrade {up:.1f} s "
                   f"(downgrade {down:.1f} s)")
    out.append(f"history inserted in {large.seeded.seconds:.0f} s")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"],
                    choices=["sqlite", "postgresql"])
    ap.add_argument("--sizes", nargs=2, type=int, default=[100, 100_000])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--connections", type=int, default=10)
    ap.add_argument("--database-url", default=PG_SERVER, help="the PostgreSQL server to use")
    ap.add_argument("--runs", type=int, default=1, help="runs of each request; medians")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    lines: list[str] = []
    for backend in args.backends:
        lines += [*report(*measure(args, backend)), ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
