"""The DB scheduler on a simulated fleet: GPU utilisation, wait by job size, decision latency.

A fleet of --nodes workers with --gpus simulated GPUs each is registered in a scratch
PostgreSQL database (as `ftune worker` with FTUNE_FAKE_GPUS registers itself). The API runs
as its own process (uvicorn, as `ftune api`); --jobs jobs of mixed sizes (1/2/4/8 GPUs) and
lengths are submitted through it over HTTP, from several tenants. Each node has one slot
thread per GPU that does what a worker's pool thread does: wait for a doorbell, make a
scheduling decision with the real claim (worker/run/claim.py ``claim_next``: decision lock,
queue window, placement, allocation rows), "run" the job, finish it with the real state
machine move (which frees its GPUs), and ring the workers that now have room
(``ring_workers_with_work``).

What is simulated, and why: the trainer is a sleep of the job's length (an `accelerate
launch` per job costs ~3 s of CPU here, and 1,000 of them on 2 shared cores would measure
the CPU, not the scheduler), and a doorbell is an in-process condition per node instead of
a Redis message (same semantics: "look now", duplicates harmless). Everything that decides
what runs where is the production code on PostgreSQL.

The whole backlog is submitted first (8 client threads), then the fleet starts: waits count
from that moment, so they measure how the scheduler drains a full queue of mixed sizes.

Each job states a time limit (``resources.timeout_seconds``), as users do: the bound of its
length class (short jobs 3 units, long ones 12), so up to 3x its real length. The scheduler
uses the limits to backfill around a reservation (core/jobs/scheduler.py); ``--no-timeouts``
submits without them (the runs before that change). The time scale is compressed (a unit is
a second, not minutes), so the grace a stopping trainer gets before it is killed, which
counts in those bounds, is compressed too (``--grace``).

Prints: makespan, GPU utilisation (busy GPU-seconds / (GPUs x span from the first start to
the last end)) split into the part where the queue still held jobs (first start to last
start) and the drain tail (last start to last end: too few jobs left to fill the GPUs), wait
p50/p99/max by job size and how late each size started against a perfectly packed FIFO,
the reserved jobs and whether each started by the bound its queue message stated, decision
latency p50/p99, the load average, and a check that no GPU was ever held by two jobs at
once.

``--policy-only`` replays the same jobs through the scheduler's rules alone
(``core.jobs.scheduler.decide`` in simulated time, every decision instant, no database): what the
policy reaches when nothing else costs time, to tell its losses from the machine's.

    python -m bench.scheduler                      # 1000 jobs, 4 nodes x 8 GPUs
    python -m bench.scheduler --jobs 200 --scale 0.2
    python -m bench.scheduler --policy-only
    python -m bench.scheduler --deep-queue         # decision time, 100 vs 10,000 queued
                                                   # (bench/deep_queue.py)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

from bench.apiserver import running_api

SIZES = [(1, 0.50), (2, 0.25), (4, 0.15), (8, 0.10)]


@dataclass
class Run:
    job_id: str
    size: int
    length: float
    submitted: float
    order: int = 0  # place in queue order (all jobs have the same priority: creation order)
    node: str = ""
    gpus: tuple[int, ...] = ()
    started: float = 0.0
    ended: float = 0.0


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))] if v else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.5,
                    help="seconds per unit of job length (short jobs 1-3 units, long 6-12)")
    ap.add_argument("--reserve-after", type=float, default=10.0,
                    help="FTUNE_RESERVE_AFTER_SECONDS for the run (seconds)")
    ap.add_argument("--no-timeouts", action="store_true",
                    help="submit jobs without resources.timeout_seconds")
    ap.add_argument("--grace", type=float, default=1.0,
                    help="FTUNE_CANCEL_GRACE_SECONDS for the run (seconds)")
    ap.add_argument("--database-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy-only", action="store_true",
                    help="the scheduler's rules alone, in simulated time (see above)")
    ap.add_argument("--deep-queue", action="store_true",
                    help="decision time with 100 and 10,000 queued jobs (bench/deep_queue.py)")
    args = ap.parse_args()
    if args.deep_queue:
        from bench import deep_queue

        deep_queue.main(["--database-url", args.database_url, "--nodes", str(args.nodes),
                         "--gpus", str(args.gpus)])
        return
    if args.policy_only:
        simulate(args, make_plan(args))
        return

    data_root = Path(tempfile.mkdtemp(prefix="ftune-bench-sched-"))
    env = {"FTUNE_RESERVE_AFTER_SECONDS": str(args.reserve_after),
           "FTUNE_CANCEL_GRACE_SECONDS": str(args.grace),
           "FTUNE_ALLOWED_DATA_ROOTS": str(data_root), "FTUNE_LOG_LEVEL": "WARNING"}
    with running_api(args.database_url, log_level="WARNING", extra_env=env) as api:
        os.environ.update({"DATABASE_URL": api.database_url, "FTUNE_DATA_DIR": str(api.data_dir),
                           "BROKER_URL": "filesystem://", **env})
        run_bench(args, make_plan(args), api.url, api.key)


def make_plan(args: argparse.Namespace) -> list[tuple[int, int, float, int]]:
    """(index, GPUs, length in units, time limit in seconds) of each job, from the seed."""
    rng = random.Random(args.seed)
    plan = []
    for i in range(args.jobs):
        size = rng.choices([s for s, _ in SIZES], [w for _, w in SIZES])[0]
        short = rng.random() < 0.7
        units = rng.uniform(1, 3) if short else rng.uniform(6, 12)
        plan.append((i, size, units, math.ceil((3 if short else 12) * args.scale)))
    return plan


# (The API's submit path is thread-safe; httpx.Client is too.)


def run_bench(args: argparse.Namespace, plan: list[tuple[int, int, float, int]], url: str,
              admin_key: str) -> None:
    from core.db.models import GpuAllocation, JobStatus, utcnow
    from core.db.session import session_scope
    from core.infra.settings import get_settings
    from core.jobs import state as jobstate
    from worker.run import claim as claim_mod
    from worker.upkeep.registry import Inventory, register, start_heartbeat_thread
    from worker.upkeep.registry import heartbeat as worker_heartbeat

    settings = get_settings()
    _one_connection_per_thread(args.nodes * args.gpus + args.nodes + 8)
    held = _time_decisions()
    promised = _track_reservations()
    nodes = [f"node-{i}" for i in range(args.nodes)]
    inv = Inventory("bench", [{"index": i, "name": "H100", "memory_mb": 81559}
                              for i in range(args.gpus)], 16,
                    {"cuda": True, "bf16": True, "flash_attn": False, "max_machines": 1,
                     "simulated": True}, args.gpus)
    stop = threading.Event()
    with session_scope() as s:
        for n in nodes:
            register(s, n, inv)
    for n in nodes:
        start_heartbeat_thread(settings, n, stop)

    # Doorbells: one counter and condition per node.
    bells = {n: 0 for n in nodes}
    cv = {n: threading.Condition() for n in nodes}

    def ring(worker_ids: list[str]) -> None:
        for wid in worker_ids:
            if wid in cv:
                with cv[wid]:
                    bells[wid] += 1
                    cv[wid].notify()

    claim_mod._ring = ring  # the in-process doorbell (see module doc)

    runs: dict[str, Run] = {}
    decisions: list[float] = []
    placed_decisions: list[float] = []
    lock = threading.Lock()
    done = threading.Event()

    def slot(node: str) -> None:
        while not done.is_set():
            with cv[node]:
                if bells[node] == 0:
                    cv[node].wait(timeout=30.0)  # a backstop only: work comes with a bell
                if done.is_set():
                    return
                if bells[node] > 0:
                    bells[node] -= 1
            t0 = time.perf_counter()
            c = claim_mod.claim_next(settings, node, own_bell=True)
            dt = time.perf_counter() - t0
            with lock:
                decisions.append(dt)
                if c is not None:
                    placed_decisions.append(dt)
            if c is None:
                continue
            r = runs[c.job_id]
            r.node, r.gpus, r.started = node, c.gpu_ids, time.time()
            time.sleep(r.length)
            with session_scope() as s:
                ok = jobstate.finish(s, c.job_id, claim_mod.holder(c), previous=JobStatus.running,
                                     to=JobStatus.succeeded, now=utcnow())
                worker_heartbeat(s, node)
            assert ok, c.job_id
            r.ended = time.time()
            claim_mod.ring_workers_with_work(settings)
            with lock:
                if all(x.ended for x in runs.values()) and len(runs) == args.jobs:
                    done.set()

    # Submit through the API, from several tenants: the whole backlog first, so that the
    # fleet is measured draining a full queue (waits count from the moment it starts).
    client = httpx.Client(base_url=url, timeout=120)
    keys = [admin_key]
    with session_scope() as s:
        from api.services.keys import create_api_key

        keys += [create_api_key(s, f"bench-tenant-{i}") for i in range(1, args.tenants)]
    data = Path(os.environ["FTUNE_ALLOWED_DATA_ROOTS"]) / "train.jsonl"
    data.write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(16)))
    submit_t0 = time.time()

    def submit(item: tuple[int, int, float, int]) -> None:
        i, size, units, limit = item
        spec: dict[str, object] = {
            "name": f"bench-{i}", "model": {"name_or_path": "org/tiny-model"},
            "dataset": {"path": str(data), "format": "text"}, "training": {"max_steps": 10}}
        if size > 1:
            spec["distributed"] = {"strategy": "ddp", "num_processes": size}
        if not args.no_timeouts:
            spec["resources"] = {"timeout_seconds": limit}
        r = client.post("/v1/jobs", json=spec,
                        headers={"Authorization": f"Bearer {keys[i % len(keys)]}"})
        if r.status_code != 201:
            raise SystemExit(f"submit {i}: {r.status_code} {r.text}")
        job = r.json()
        created = datetime.fromisoformat(job["created_at"]).timestamp()
        with lock:
            runs[job["id"]] = Run(job["id"], size, units * args.scale, created)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(submit, plan))
    submit_s = time.time() - submit_t0
    for k, r in enumerate(sorted(runs.values(), key=lambda r: (r.submitted, r.job_id))):
        r.order = k

    threads = [threading.Thread(target=slot, args=(n,), daemon=True)
               for n in nodes for _ in range(args.gpus)]
    load_before = os.getloadavg()
    fleet_start = time.time()
    for r in runs.values():
        r.submitted = max(r.submitted, fleet_start)
    for t in threads:
        t.start()
    for n in nodes:  # the submissions' doorbells, one per job, to any worker
        ring([n] * args.gpus)

    if not done.wait(timeout=3600):
        raise SystemExit("the jobs did not finish in an hour")
    stop.set()
    for n in nodes:
        with cv[n]:
            cv[n].notify_all()
    for t in threads:
        t.join(10)
    report(args, list(runs.values()), decisions, placed_decisions, submit_s,
           {j: (a.timestamp(), b.timestamp() if b else None) for j, (a, b) in promised.items()})
    print(f"load average (1/5/15 min) as the fleet started: "
          f"{' / '.join(f'{x:.1f}' for x in load_before)}; at the end: "
          f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (this machine: "
          f"{os.cpu_count()} cores)")
    print(f"decision time with the lock held: p50 {statistics.median(held) * 1000:.1f} ms, "
          f"p99 {pct(held, 0.99) * 1000:.1f} ms; the lock was held {sum(held):.0f} s of the "
          f"run")
    with session_scope() as s:
        left = s.query(GpuAllocation).count()
    print(f"allocations left after the run: {left} (must be 0)")


def simulate(args: argparse.Namespace, plan: list[tuple[int, int, float, int]]) -> None:
    """The plan through ``core.jobs.scheduler.decide`` alone: every worker decides at each event
    until none places anything, a placement takes no time, a job ends exactly after its
    length. Same fleet, sizes, lengths, limits, tenants and settings as a real run."""
    import heapq
    from datetime import UTC, timedelta

    from core.infra.settings import Settings
    from core.jobs import scheduler
    from core.policy.fleet import Inventory
    from core.spec import JobSpec

    settings = Settings(reserve_after_seconds=args.reserve_after,
                        cancel_grace_seconds=args.grace)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    specs: dict[tuple[int, int | None], JobSpec] = {}
    queue, runs = [], {}
    for i, size, units, limit in plan:
        key = (size, None if args.no_timeouts else limit)
        if key not in specs:
            body: dict[str, object] = {"model": {"name_or_path": "/m"},
                                       "dataset": {"path": "/d.jsonl"},
                                       "resources": {"timeout_seconds": key[1]}}
            if size > 1:
                body["distributed"] = {"strategy": "ddp", "num_processes": size}
            specs[key] = JobSpec.model_validate(body)
        tenant = f"t{i % args.tenants}"
        queue.append(scheduler.Candidate(f"job-{i:05d}", tenant, tenant, 0,
                                         t0 + timedelta(microseconds=i), 0, 0, False, specs[key]))
        runs[f"job-{i:05d}"] = Run(f"job-{i:05d}", size, units * args.scale, 0.0, order=i)
    inv = [Inventory(f"node-{n}", args.gpus, slots=args.gpus,
                     capabilities={"cuda": True, "bf16": True}) for n in range(args.nodes)]
    state = scheduler.FleetState(
        {w.id: scheduler.WorkerView(w, "active", True, list(range(args.gpus)),
                                    list(range(args.gpus)), [], 0) for w in inv}, [])
    ends: list[tuple[float, str, str, tuple[int, ...]]] = []
    promised = _track_reservations()
    now = 0.0
    while True:
        moment = t0 + timedelta(seconds=now)
        placed = True
        while placed:
            placed = False
            state.queue = queue[:scheduler.QUEUE_WINDOW]
            for wid in state.workers:
                p = scheduler.decide(state, wid, settings, moment)
                if p is None:
                    continue
                scheduler.place(state, wid, p, settings, moment)
                queue = [c for c in queue if c.id != p.job_id]
                state.queue = queue[:scheduler.QUEUE_WINDOW]
                r = runs[p.job_id]
                r.node, r.gpus, r.started = wid, tuple(p.gpu_ids), now
                heapq.heappush(ends, (now + r.length, p.job_id, wid, r.gpus))
                placed = True
        if not ends:
            break
        now, job_id, wid, gpus = heapq.heappop(ends)
        runs[job_id].ended = now
        w = state.workers[wid]
        w.free_gpus += list(gpus)
        w.running -= 1
        w.holding = [h for h in w.holding if h.job_id != job_id]
        tenant = f"t{int(job_id.split('-')[1]) % args.tenants}"
        state.tenant_jobs[tenant] -= 1
        state.tenant_gpus[tenant] -= len(gpus)
    if queue:
        raise SystemExit(f"{len(queue)} jobs never started")
    print("policy only: core.jobs.scheduler.decide in simulated time, decisions instant")
    def clock(t: datetime | None) -> float | None:
        return None if t is None else (t - t0).total_seconds()

    report(args, list(runs.values()), [], [], None,
           {j: (clock(a) or 0.0, clock(b)) for j, (a, b) in promised.items()})


def _one_connection_per_thread(n: int) -> None:
    """This process plays every worker of the fleet: give it a connection per slot thread
    (a real worker process has one pool thread per GPU, well within the default pool)."""
    from functools import lru_cache

    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from core.db import session as db

    engine = create_engine(os.environ["DATABASE_URL"], pool_pre_ping=True, pool_size=n,
                           max_overflow=8)
    maker = sessionmaker(bind=engine, expire_on_commit=False)
    db.get_sessionmaker = lru_cache(maxsize=1)(lambda: maker)  # type: ignore[assignment]


def _track_reservations() -> dict[str, tuple[datetime, datetime | None]]:
    """Job -> (when it first held a reservation, the earliest start bound it was given: the
    ``starts_by`` its queue.message states; None: no bound known)."""
    from core.jobs import scheduler

    seen: dict[str, tuple[datetime, datetime | None]] = {}
    lock = threading.Lock()
    plan = scheduler.plan

    def tracked(state, settings, now, **kw):  # type: ignore[no-untyped-def]
        planned = plan(state, settings, now, **kw)
        if (held := planned.held) is not None:
            with lock:
                first, bound = seen.get(held.job_id, (now, held.starts_by))
                if bound is not None and held.starts_by is not None:
                    bound = min(bound, held.starts_by)
                seen[held.job_id] = (first, bound)
        return planned

    scheduler.plan = tracked  # type: ignore[assignment]
    return seen


def _time_decisions() -> list[float]:
    """Time from taking the decision lock to the end of the decision (before the commit)."""
    from core.jobs import queue_load
    from worker.run import claim

    held: list[float] = []
    local = threading.local()
    lock, decide = queue_load.lock_decisions, claim._decide_and_claim

    def timed_lock(session):  # type: ignore[no-untyped-def]
        lock(session)
        local.t = time.perf_counter()

    def timed_decide(session, settings, worker_id, **kw):  # type: ignore[no-untyped-def]
        try:
            return decide(session, settings, worker_id, **kw)
        finally:
            held.append(time.perf_counter() - local.t)

    queue_load.lock_decisions = timed_lock  # type: ignore[assignment]
    claim._decide_and_claim = timed_decide  # type: ignore[assignment]
    return held


def report(args: argparse.Namespace, runs: list[Run], decisions: list[float],
           placed: list[float], submit_s: float | None,
           promised: dict[str, tuple[float, float | None]]) -> None:
    """``promised``: job -> (when it first held a reservation, the start bound it was given),
    on the clock of the runs' times."""
    gpus = args.nodes * args.gpus
    first, last = min(r.started for r in runs), max(r.ended for r in runs)
    last_start = max(r.started for r in runs)
    span = last - first
    busy = sum(r.size * (r.ended - r.started) for r in runs)
    capacity = gpus * span
    work = sum(r.size * r.length for r in runs)
    submitted = (f"submitted through the API in {submit_s:.1f} s "
                 f"({len(runs) / submit_s:.0f} jobs/s); " if submit_s else "")
    print(f"fleet: {args.nodes} nodes x {args.gpus} simulated GPUs; {len(runs)} jobs "
          f"({', '.join(f'{s} GPU: {sum(r.size == s for r in runs)}' for s, _ in SIZES)}); "
          f"{submitted}time limits: {'none' if args.no_timeouts else 'per length class'}")
    print(f"makespan {span:.1f} s (first start to last end); lower bound from the work alone "
          f"{work / gpus:.1f} s")
    print(f"GPU utilisation: {busy / capacity:.1%} (busy GPU-seconds {busy:.0f} / "
          f"{capacity:.0f} available)")

    def busy_in(a: float, b: float) -> float:
        return sum(r.size * max(0.0, min(r.ended, b) - max(r.started, a)) for r in runs)

    queued = busy_in(first, last_start)
    tail = busy_in(last_start, last)
    print(f"  while the queue held jobs (first start to last start, {last_start - first:.1f} s): "
          f"{queued / (gpus * (last_start - first)):.1%}")
    print(f"  drain tail (last start to last end, {last - last_start:.1f} s): "
          f"{tail / (gpus * (last - last_start)):.1%}, "
          f"{gpus * (last - last_start) - tail:.0f} idle GPU-seconds "
          f"({(gpus * (last - last_start) - tail) / capacity:.1%} of the available)")
    by_size: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        by_size[r.size].append(r.started - r.submitted)
    # How late each job started against strict FIFO on a perfectly packed fleet: there, a
    # job starts once the GPU-seconds of the jobs ahead of it in queue order have run.
    late: dict[int, list[float]] = defaultdict(list)
    ahead = 0.0
    for r in sorted(runs, key=lambda r: r.order):
        late[r.size].append((r.started - first) - ahead / gpus)
        ahead += r.size * (r.ended - r.started)
    for size in sorted(by_size):
        w = by_size[size]
        print(f"wait, {size} GPU jobs: p50 {statistics.median(w):.1f} s, p99 {pct(w, 0.99):.1f} s, "
              f"max {max(w):.1f} s; later than packed FIFO: p50 "
              f"{statistics.median(late[size]):.1f} s, max {max(late[size]):.1f} s (n={len(w)})")
    reserved = [(r, *promised[r.job_id]) for r in runs if r.job_id in promised]
    bounded = [(r, since, by) for r, since, by in reserved if by is not None]
    late_by = [r.started - by for r, _, by in bounded]
    print(f"reservations: {len(reserved)} jobs held one ({len(bounded)} with a start bound); "
          f"started after their bound: {sum(d > 0 for d in late_by)}"
          + (f" (by at most {max(late_by):.2f} s)" if late_by and max(late_by) > 0 else "")
          + (f"; bound minus the moment of reservation: max "
             f"{max(by - since for _, since, by in bounded):.1f} s; reservation to start: "
             f"p50 {statistics.median(r.started - since for r, since, _ in reserved):.1f} s, "
             f"max {max(r.started - since for r, since, _ in reserved):.1f} s"
             if bounded else ""))
    if not decisions:
        return
    print(f"decision latency (claim_next, one transaction): all p50 "
          f"{statistics.median(decisions) * 1000:.1f} ms p99 {pct(decisions, 0.99) * 1000:.1f} ms"
          f" (n={len(decisions)}); placing a job p50 {statistics.median(placed) * 1000:.1f} ms "
          f"p99 {pct(placed, 0.99) * 1000:.1f} ms")
    # No GPU held by two jobs at once: per (node, gpu), intervals never overlap.
    held: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        for g in r.gpus:
            held[(r.node, g)].append((r.started, r.ended))
    overlaps = sum(1 for iv in held.values() for a, b in zip(sorted(iv), sorted(iv)[1:])
                   if b[0] < a[1])
    print(f"GPU double-bookings: {overlaps} (must be 0)")


if __name__ == "__main__":
    main()
