"""The jobs of a scheduler bench run (bench/scheduler.py): their mix of sizes and lengths
(``make_plan``), the record of each as it ran (``Run``), the reservations the scheduler
promised them (``track_reservations``), and the report on a run: makespan, GPU utilisation,
wait by size, reservations kept, decision latency, double bookings.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

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


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))] if v else float("nan")


def track_reservations() -> dict[str, tuple[datetime, datetime | None]]:
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
