"""A deep queue: the scheduler's decision with 100 and with 10,000 queued jobs, on PostgreSQL
(``python -m bench.scheduler --deep-queue``).

A fleet of --nodes workers with --gpus free (simulated) GPUs each is registered in a scratch
database; queued jobs of four tenants and mixed priorities are inserted straight into it
(bench/history_rows.py ``queued_jobs``). At each depth a worker makes --decisions real
decisions (worker/run/claim.py ``_decide_and_claim``: decision lock, queue window, plan,
claim, allocation rows), each rolled back instead of committed so the queue keeps its depth.
Prints the decision's p50/p99 at each depth and their ratio, and the statements one claim
runs (the claim is one transaction: its statement count does not grow with the queue).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from sqlalchemy import create_engine, event


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def run(args: argparse.Namespace) -> None:
    from testkit.pg import migrated_database

    with migrated_database("ftune_bench_queue", args.database_url) as url:
        os.environ.update({"DATABASE_URL": url, "BROKER_URL": "filesystem://",
                           "FTUNE_DATA_DIR": tempfile.mkdtemp(prefix="ftune-deep-queue-"),
                           "FTUNE_LOG_LEVEL": "WARNING"})
        _measure(args, url)


def _measure(args: argparse.Namespace, url: str) -> None:
    from bench.history_rows import queued_jobs
    from core.db.session import get_engine, session_scope
    from core.infra.settings import get_settings, reset_settings_cache
    from worker.run.claim import _decide_and_claim
    from worker.upkeep.registry import Inventory, register

    reset_settings_cache()
    settings = get_settings()
    inv = Inventory("bench", [{"index": i, "name": "H100", "memory_mb": 81559}
                              for i in range(args.gpus)], 16,
                    {"cuda": True, "bf16": True, "flash_attn": False, "max_machines": 1,
                     "simulated": True}, args.gpus)
    nodes = [f"node-{i}" for i in range(args.nodes)]
    with session_scope() as s:
        for n in nodes:
            register(s, n, inv)
    statements: list[str] = []
    event.listen(get_engine(), "before_cursor_execute",
                 lambda conn, cursor, stmt, *a: statements.append(stmt))
    engine = create_engine(url)
    depths = sorted(args.depths)
    queued, results = 0, {}
    for depth in depths:
        queued_jobs(engine, depth - queued, seed_value=depth)
        queued = depth
        with engine.connect() as c:
            c.exec_driver_sql("ANALYZE jobs")
            c.commit()
        times, counts = [], []
        for k in range(args.decisions + 3):
            statements.clear()
            with session_scope() as s:
                t0 = time.perf_counter()
                claim = _decide_and_claim(s, settings, nodes[k % len(nodes)], forward=False)
                dt = time.perf_counter() - t0
                assert claim is not None, "a worker with free GPUs must start a queued job"
                s.rollback()  # the queue keeps its depth
            if k >= 3:  # the first ones parse the window's specs (then cached)
                times.append(dt)
                counts.append(len(statements))
        results[depth] = (times, counts)
        print(f"  {depth:>6,} queued: decision + claim p50 {statistics.median(times) * 1000:.1f} "
              f"ms, p99 {pct(times, 0.99) * 1000:.1f} ms; {max(counts)} statements in its "
              "transaction", flush=True)
    engine.dispose()
    small, large = (statistics.median(results[d][0]) for d in (depths[0], depths[-1]))
    print(f"deep queue: p50 with {depths[-1]:,} queued / with {depths[0]:,}: "
          f"{large / small:.2f}x (target <= 2x)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[100, 10_000])
    ap.add_argument("--decisions", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--database-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
