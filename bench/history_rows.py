"""A service's history as rows, inserted straight into the database (seconds for 100,000 jobs,
where submitting them through the API would take an hour): jobs of several tenants over two
years, mostly finished (succeeded, failed, cancelled) with their attempts, usage days, events
and OpenAI metadata, and the few queued and running ones a live service has whatever its age.
The rows are what the API and the worker write (same columns, same JSON), so every read
path sees a realistic table: varied times, statuses, tenants and metadata.

Used by bench/growth.py (requests at 100 and 100,000 jobs) and bench/scheduler.py
``--deep-queue`` (``queued_jobs``).
"""

from __future__ import annotations

import json
import random
import secrets
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core.db.models import (
    Job,
    JobAttempt,
    JobEvent,
    JobMetadata,
    JobStatusCount,
    Tenant,
    UsageDay,
    UsageTotal,
    new_id,
    utcnow,
)
from core.jobs.state import shard_of

SPAN = timedelta(days=730)  # the history: two years
CHUNK = 5_000  # rows per INSERT batch
ACTIVE_QUEUED, ACTIVE_RUNNING = 10, 5  # the newest jobs of the key's tenant, at any size
RARE_LABEL = ("release", "rc")  # metadata that 5 jobs of the key's tenant carry, at any size
RARE_JOBS = 5
OTHER_TENANTS = 4
KEY_TENANT_SHARE = 0.4  # of the jobs: the key's tenant ("default")


def spec(rng: random.Random, i: int) -> dict[str, Any]:
    """A JobSpec as stored at submit (the validated request, defaults unset)."""
    processes = rng.choice([1, 1, 1, 2, 4, 8])
    return {
        "name": f"ci-run-{i}",
        "model": {"name_or_path": rng.choice(["org/tiny-llama", "org/small-qwen", "org/t5"])},
        "dataset": {"file_id": f"file-{i % 97:024x}", "format": "chat"},
        "training": {"max_steps": rng.choice([50, 100, 500, 2000]),
                     "learning_rate": rng.choice([1e-4, 2e-4, 5e-5])},
        "distributed": ({"strategy": "ddp", "num_processes": processes} if processes > 1
                        else {"strategy": "none", "num_processes": 1}),
    }


@dataclass
class Seeded:
    tenant_id: str  # the key's tenant ("default")
    job_ids: list[str]  # the key's tenant's jobs, newest first
    events_job: str  # the key's tenant's job with ``events`` events
    events: int
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


def _tenants(s: Session) -> tuple[str, list[str]]:
    key_tenant = s.scalar(select(Tenant.id).where(Tenant.name == "default"))
    assert key_tenant is not None, "the bootstrap key's tenant is made when the API starts"
    others = []
    for _ in range(OTHER_TENANTS):
        t = Tenant(name=f"team-{secrets.token_hex(4)}")
        s.add(t)
        others.append(t)
    s.flush()
    return key_tenant, [t.id for t in others]


def _batches(rows: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for r in rows:
        batch.append(r)
        if len(batch) >= CHUNK:
            yield batch
            batch = []
    if batch:
        yield batch


def _driver_value(value: Any, sqlite: bool) -> Any:
    """A value as the driver takes it, as SQLAlchemy's column types would have bound it
    (UTCDateTime on SQLite: the UTC wall time as text; JSON: its text)."""
    if isinstance(value, dict | list):
        if sqlite:
            return json.dumps(value)
        from psycopg.types.json import Jsonb

        return Jsonb(value)
    if sqlite and isinstance(value, datetime):
        return value.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")
    if sqlite and isinstance(value, date):
        return value.isoformat()
    return value


def insert_rows(s: Session, table: Any, rows: list[dict[str, Any]]) -> None:
    """Rows of one shape into ``table`` through the driver (COPY on PostgreSQL, one
    executemany per chunk on SQLite): a tenth of the time of SQLAlchemy's insert, whose
    per-value bind processing dominated building 100,000 jobs."""
    if not rows:
        return
    columns = list(rows[0])
    name = table.__tablename__
    raw = s.connection().connection.driver_connection
    assert raw is not None
    if s.get_bind().dialect.name == "sqlite":
        sql = (f"INSERT INTO {name} ({', '.join(columns)}) "
               f"VALUES ({', '.join('?' for _ in columns)})")
        for batch in _batches(iter(rows)):
            raw.executemany(sql, [tuple(_driver_value(r[c], True) for c in columns)
                                  for r in batch])
        return
    with raw.cursor() as cur, cur.copy(f"COPY {name} ({', '.join(columns)}) FROM STDIN") as copy:
        for r in rows:
            copy.write_row([_driver_value(r[c], False) for c in columns])


def seed(engine: Engine, jobs: int, events_job_events: int, seed_value: int = 0) -> Seeded:
    """``jobs`` jobs (the newest ACTIVE_* of the key's tenant queued and running, the rest
    finished over SPAN) and one finished job of the key's tenant with ``events_job_events``
    events."""
    import time

    started = time.perf_counter()
    rng = random.Random(seed_value)
    now = utcnow()
    with Session(engine) as s:
        key_tenant, others = _tenants(s)
        s.commit()
        # Creation times, newest first: the key's tenant's newest jobs are the live ones.
        ages = sorted(rng.uniform(60, SPAN.total_seconds()) for _ in range(jobs))
        owners = [key_tenant if rng.random() < KEY_TENANT_SHARE else rng.choice(others)
                  for _ in range(jobs)]
        mine = [i for i, t in enumerate(owners) if t == key_tenant]
        live = {i: "queued" for i in mine[:ACTIVE_QUEUED]}
        live.update({i: "running" for i in mine[ACTIVE_QUEUED:ACTIVE_QUEUED + ACTIVE_RUNNING]})
        rare = set(mine[ACTIVE_QUEUED + ACTIVE_RUNNING:][::max(1, len(mine) // RARE_JOBS)]
                   [:RARE_JOBS])
        job_rows, attempt_rows, meta_rows, event_rows = [], [], [], []
        days: dict[tuple[str, date], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        day_jobs: dict[tuple[str, date], set[str]] = defaultdict(set)
        ids = [new_id("job") for _ in range(jobs)]
        for i, (job_id, age, tenant) in enumerate(zip(ids, ages, owners, strict=True)):
            created = now - timedelta(seconds=age)
            status = live.get(i) or rng.choices(["succeeded", "failed", "cancelled"],
                                                [0.82, 0.1, 0.08])[0]
            sp = spec(rng, i)
            processes = sp["distributed"]["num_processes"]
            row: dict[str, Any] = {
                "id": job_id, "tenant_id": tenant, "name": sp["name"], "status": status,
                "spec": sp, "request": sp, "priority": rng.choice([0, 0, 0, 1, 5]),
                "created_at": created, "queued_at": created, "attempt": 0, "pauses": 0,
                "paused_seconds": 0.0, "events_offset": 0, "step": 0,
            }
            openai = rng.random() < 0.3 or i in rare
            metadata = ({"pipeline": f"ci-{i % 50}", "commit": f"{rng.getrandbits(40):010x}"}
                        if openai else None)
            if metadata is not None and i in rare:
                metadata[RARE_LABEL[0]] = RARE_LABEL[1]
            if openai:
                row["openai"] = {"model": "tiny", "method_type": "supervised",
                                 "metadata": metadata, "suffix": None, "seed": i}
                meta_rows += [{"job_id": job_id, "key": k, "tenant_id": tenant, "value": v,
                               "created_at": created} for k, v in (metadata or {}).items()]
            if status != "queued" and not (status == "cancelled" and rng.random() < 0.5):
                n_attempts = 2 if rng.random() < 0.05 else 1
                start = created + timedelta(seconds=rng.uniform(1, 600))
                for n in range(1, n_attempts + 1):
                    seconds = rng.uniform(300, 3 * 3600)
                    end = start + timedelta(seconds=seconds)
                    last = n == n_attempts
                    ended = None if (status == "running" and last) else end
                    tokens = int(seconds * rng.uniform(500, 5000))
                    attempt_rows.append({
                        "job_id": job_id, "attempt": n, "worker_id": f"gpu-{i % 8}",
                        "started_at": start, "ended_at": ended, "processes": processes,
                        "device": "cuda", "tokens": tokens, "loss_tokens": tokens // 3})
                    if ended is not None:
                        d = days[(tenant, ended.date())]
                        d["attempts"] += 1
                        d["tokens"] += tokens
                        d["loss_tokens"] += tokens // 3
                        d["wall_seconds"] += seconds
                        d["gpu_seconds"] += seconds * processes
                        day_jobs[(tenant, ended.date())].add(job_id)
                    start = end + timedelta(seconds=60)
                steps = sp["training"]["max_steps"]
                row.update(attempt=n_attempts, started_at=created + timedelta(seconds=30),
                           step=steps if status == "succeeded" else steps // 2,
                           total_steps=steps, train_loss=rng.uniform(0.5, 2.5),
                           tokens_per_second=rng.uniform(1000, 20000),
                           heartbeat_at=now if status == "running" else None,
                           worker_id=f"gpu-{i % 8}" if status == "running" else None)
                if status != "running":
                    row["finished_at"] = start
                if status == "failed":
                    row.update(error_code="out_of_memory", error_message="CUDA out of memory")
            job_rows.append(row)
            event_rows += _job_events(job_id, created, status, row.get("step", 0))
        usage_rows = [{"tenant_id": t, "day": d, "attempts": int(v["attempts"]),
                       "jobs": len(day_jobs[(t, d)]), "tokens": int(v["tokens"]),
                       "loss_tokens": int(v["loss_tokens"]), "wall_seconds": v["wall_seconds"],
                       "gpu_seconds": v["gpu_seconds"]} for (t, d), v in days.items()]
        totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for (t, _), v in days.items():
            for k in ("attempts", "tokens", "loss_tokens", "wall_seconds", "gpu_seconds"):
                totals[t][k] += v[k]
        total_rows = [{"tenant_id": t, "attempts": int(v["attempts"]), "tokens": int(v["tokens"]),
                       "loss_tokens": int(v["loss_tokens"]), "wall_seconds": v["wall_seconds"],
                       "gpu_seconds": v["gpu_seconds"]} for t, v in totals.items()]
        events_job = next(ids[i] for i in mine if live.get(i) is None)
        columns = set().union(*job_rows) if job_rows else set()
        job_rows = [{c: r.get(c) for c in columns} for r in job_rows]  # one shape per INSERT
        for table, rows in ((Job, job_rows), (JobAttempt, attempt_rows),
                            (JobMetadata, meta_rows), (UsageDay, usage_rows),
                            (UsageTotal, total_rows), (JobEvent, event_rows)):
            insert_rows(s, table, rows)
        insert_rows(s, JobEvent, list(_many_events(events_job, now, events_job_events)))
        add_status_counts(s, job_rows)
        s.commit()
    mine_newest_first = [ids[i] for i in mine]
    return Seeded(key_tenant, mine_newest_first, events_job, events_job_events,
                  time.perf_counter() - started,
                  {"jobs": len(job_rows), "attempts": len(attempt_rows),
                   "metadata": len(meta_rows), "events": len(event_rows) + events_job_events})


def _job_events(job_id: str, created: datetime, status: str, step: int) -> list[dict[str, Any]]:
    """What a job's life writes: its status moves and a few progress lines."""
    out = [{"job_id": job_id, "created_at": created, "type": "status", "message": "queued",
            "data": {"status": "queued", "previous": None}}]
    if status == "queued":
        return out
    t = created + timedelta(seconds=30)
    out.append({"job_id": job_id, "created_at": t, "type": "status", "message": "running",
                "data": {"status": "running", "previous": "queued"}})
    for k in range(1, 3):
        out.append({"job_id": job_id, "created_at": t + timedelta(seconds=k), "type": "progress",
                    "message": f"step {k * step // 2}", "data": {"step": k * step // 2,
                                                                  "loss": 1.0 / k}})
    if status != "running":
        out.append({"job_id": job_id, "created_at": t + timedelta(seconds=9), "type": "status",
                    "message": status, "data": {"status": status, "previous": "running"}})
    return out


def _many_events(job_id: str, now: datetime, n: int) -> Iterator[dict[str, Any]]:
    """A long run's progress log: ``n`` events a second apart, ending now."""
    start = now - timedelta(seconds=n)
    for k in range(n):
        yield {"job_id": job_id, "created_at": start + timedelta(seconds=k), "type": "progress",
               "message": f"step {k}", "data": {"step": k, "loss": 2.0 / (1 + k / 1000),
                                                 "learning_rate": 2e-4}}


def queued_jobs(engine: Engine, n: int, seed_value: int = 0) -> list[str]:
    """``n`` queued jobs of several tenants and priorities (a deep queue), one GPU each."""
    rng = random.Random(seed_value)
    now = utcnow()
    with Session(engine) as s:
        tenants = [Tenant(name=f"queue-{secrets.token_hex(4)}") for _ in range(OTHER_TENANTS)]
        s.add_all(tenants)
        s.flush()
        ids = [new_id("job") for _ in range(n)]
        rows = []
        for i, job_id in enumerate(ids):
            created = now - timedelta(seconds=rng.uniform(1, 86400))
            sp = spec(rng, i)
            sp["distributed"] = {"strategy": "none", "num_processes": 1}
            rows.append({"id": job_id, "tenant_id": rng.choice(tenants).id, "status": "queued",
                         "spec": sp, "request": sp, "priority": rng.choice([0, 0, 0, 1, 5]),
                         "created_at": created, "queued_at": created, "attempt": 0,
                         "pauses": 0, "paused_seconds": 0.0, "events_offset": 0, "step": 0})
        insert_rows(s, Job, rows)
        add_status_counts(s, rows)
        s.commit()
    return ids


def add_status_counts(s: Session, job_rows: list[dict[str, Any]]) -> None:
    """Count these jobs in job_status_counts, as the state machine would have as they moved
    (core/jobs/state.py): a few upserted rows."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for r in job_rows:
        counts[(r["status"], shard_of(r["id"]))] += 1
    if not counts:
        return
    insert = postgresql.insert if s.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(JobStatusCount).values(
        [{"status": st, "shard": sh, "jobs": n} for (st, sh), n in sorted(counts.items())])
    s.execute(stmt.on_conflict_do_update(
        index_elements=["status", "shard"], set_={"jobs": JobStatusCount.jobs + stmt.excluded.jobs}))
