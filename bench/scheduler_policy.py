"""``python -m bench.scheduler --policy-only``: the same jobs through the scheduler's rules
alone (``core.jobs.scheduler.decide`` in simulated time, every decision instant, no
database): what the policy reaches when nothing else costs time.
"""

from __future__ import annotations

import argparse
from datetime import datetime

from bench.scheduler_jobs import Run, report, track_reservations


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
    promised = track_reservations()
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
