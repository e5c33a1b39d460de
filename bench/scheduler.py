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
policy reaches when nothing else costs time, to tell its losses from the machine's
(bench/scheduler_policy.py). The jobs' mix, their records and the report:
bench/scheduler_jobs.py.

    python -m bench.scheduler                      # 1000 jobs, 4 nodes x 8 GPUs
    python -m bench.scheduler --jobs 200 --scale 0.2
    python -m bench.scheduler --policy-only
    python -m bench.scheduler --deep-queue         # decision time, 100 vs 10,000 queued
                                                   # (bench/deep_queue.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

from bench.apiserver import running_api
from bench.scheduler_jobs import Run, make_plan, pct, report, track_reservations
from bench.scheduler_policy import simulate


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
    promised = track_reservations()
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


if __name__ == "__main__":
    main()
