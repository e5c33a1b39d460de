"""Fault-injection soak: submit jobs to a real stack and break things at random while they
run; then check that every job ended exactly once, with a reason.

    python -m bench.faults                     # 30 jobs, 2 workers, ~3 minutes
    python -m bench.faults --jobs 50 --seconds 240 --seed 7

The stack (testkit/faultstack.py): the API and N Celery workers as processes, a fresh
PostgreSQL database and a redis-server of its own (free loopback port, no persistence),
the fake trainer (testkit/fake_trainer.py) under the real `accelerate launch`.
Faults, one every 1-3 s: SIGKILL a worker (restarted a moment later), SIGKILL a job's
trainer processes, restart Redis (every queued message lost), FLUSHALL, deliver a job's
message twice more, cancel a job.

Then it prints the faults injected and: jobs lost (not terminal, or vanished: must be 0),
duplicate runs (two launches of one job alive at once, or more than one "started" event or
claim for one attempt: must be 0), orphan processes (anything of these jobs still alive
once all are terminal: must be 0), and the attempts requeued because their ranks were killed
from outside (a system fault: they resume from their checkpoint instead of failing
trainer_crashed). Exit status 1 if any is not 0. Loopback only.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from client import FtuneAPIError, FtuneClient, Job
from testkit.faultstack import (
    FaultStack,
    PgDatabase,
    RedisServer,
    launch_processes,
    send_run_job,
    sigkill,
)
from worker.run.process_tree import TAG_ENV

TERMINAL = {"succeeded", "failed", "cancelled"}
QUEUE = "ftune.soak"
HEARTBEAT_TIMEOUT = 4.0
GRACE = 2.0


def job_mix(rng: random.Random, n: int) -> list[tuple[str, dict[str, Any]]]:
    """(mode, extra spec) per job: mostly resumable training, some quick, some failing,
    some that only a cancel or their timeout ends."""
    kinds = (["train"] * 6 + ["succeed"] * 2 + ["crash"] + ["slow"])
    out = []
    for _ in range(n):
        mode = rng.choice(kinds)
        extra: dict[str, Any] = {}
        if mode == "train":
            extra["training"] = {"max_steps": rng.randint(10, 30), "save_steps": 4}
        if mode == "slow":
            extra["resources"] = {"timeout_seconds": rng.randint(8, 15)}
        out.append((mode, extra))
    return out


class LaunchWatcher(threading.Thread):
    """Samples the processes of every launch (by FTUNE_LAUNCH_TAG) several times a second:
    two launches of one job alive at the same moment is a duplicate run."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="launch-watcher")
        self.stop = threading.Event()
        self.violations: list[tuple[str, list[str]]] = []
        self.launches: set[str] = set()

    def run(self) -> None:
        import psutil

        needle = f"{TAG_ENV}=".encode()
        while not self.stop.wait(0.25):
            alive: dict[str, set[str]] = collections.defaultdict(set)
            for p in psutil.process_iter():
                try:
                    with open(f"/proc/{p.pid}/environ", "rb") as f:
                        env = f.read().split(b"\0")
                    if p.status() == psutil.STATUS_ZOMBIE:
                        continue
                except (OSError, psutil.Error):  # gone meanwhile, or not ours to read
                    env = []
                for e in env:
                    if e.startswith(needle):
                        tag = e[len(needle):].decode(errors="replace")
                        alive[tag.split(":", 1)[0]].add(tag)
            for job_id, tags in alive.items():
                self.launches |= tags
                if len(tags) > 1:
                    self.violations.append((job_id, sorted(tags)))


class Injector:
    def __init__(self, stack: FaultStack, redis: RedisServer, c: FtuneClient,
                 rng: random.Random, job_ids: list[str]) -> None:
        self.stack, self.redis, self.c, self.rng, self.job_ids = stack, redis, c, rng, job_ids
        self.counts: collections.Counter[str] = collections.Counter()
        self.restart_at: dict[int, float] = {}
        self.log: list[str] = []

    def active(self) -> list[dict[str, Any]]:
        """The soak's jobs not yet terminal."""
        found: list[dict[str, Any]] = []
        after = None
        try:
            while True:
                page = self.c.list_jobs(limit=100, after=after)
                found += page["data"]
                after = page.get("next_cursor")
                if not page.get("has_more") or not after:
                    break
        except (FtuneAPIError, httpx.HTTPError) as e:
            print(f"  (could not list jobs: {e})", flush=True)
            return []
        mine = set(self.job_ids)
        return [j for j in found if j["id"] in mine and j["status"] not in TERMINAL]

    def restart_due(self) -> None:
        now = time.monotonic()
        for i, at in list(self.restart_at.items()):
            if now >= at:
                self.stack.start_worker(i, wait=False)
                del self.restart_at[i]

    def inject(self) -> None:
        active = self.active()
        running = [j for j in active if j["status"] == "running"]
        choices = ["duplicate", "cancel", "restart_redis", "flush_redis"]
        alive = [i for i in self.stack.alive_workers() if i not in self.restart_at]
        if running and alive and len(alive) == len(self.stack.worker_procs):
            choices += ["kill_worker"] * 3  # keep one worker up at any time
        if running:
            choices += ["kill_ranks"] * 2
        weights = {"cancel": 0.5}
        fault = self.rng.choices(choices, [weights.get(c, 1.0) for c in choices])[0]
        if fault == "kill_worker":
            i = self.rng.choice(alive)
            self.stack.kill_worker(i)
            self.restart_at[i] = time.monotonic() + self.rng.uniform(1, 4)
            what = f"worker {i}"
        elif fault == "kill_ranks":
            job = self.rng.choice(running)
            n = sigkill(launch_processes(job["id"], job["attempt"]))
            what = f"{n} process(es) of {job['id']}"
        elif fault == "restart_redis":
            self.redis.restart()
            what = "redis"
        elif fault == "flush_redis":
            self.redis.flushall()
            what = "redis"
        elif fault == "duplicate":
            if not active:
                return
            job = self.rng.choice(active)
            send_run_job(self.redis.url, job["id"], 2, queue=QUEUE)
            what = job["id"]
        else:
            if not active:
                return
            job = self.rng.choice(active)
            self.c.cancel_job(job["id"])
            what = job["id"]
        self.counts[fault] += 1
        self.log.append(f"{time.strftime('%H:%M:%S')} {fault} {what}")


def count_duplicates(database_url: str, attempts: dict[str, int]) -> tuple[int, int, list[str]]:
    """(attempts with more than one "started" event, claims beyond one per attempt). Every
    claim is a "running" status event and increments the attempt, so a job has exactly as
    many of them as its final attempt number."""
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT job_id, type, data FROM job_events WHERE job_id = ANY(:ids) "
                "AND type IN ('started', 'status') ORDER BY id"), {"ids": list(attempts)}).all()
    finally:
        engine.dispose()
    started: collections.Counter[tuple[str, Any]] = collections.Counter()
    claims: collections.Counter[str] = collections.Counter()
    for job_id, type_, data in rows:
        data = data if isinstance(data, dict) else json.loads(data or "{}")
        if type_ == "started":
            started[(job_id, data.get("attempt"))] += 1
        elif data.get("status") == "running" and data.get("previous") == "queued":
            claims[job_id] += 1
    dup_started = [f"{j} attempt {a}" for (j, a), n in started.items() if n > 1]
    extra_claims = sum(max(0, claims[j] - a) for j, a in attempts.items())
    return len(dup_started), extra_claims, dup_started


def killed_and_requeued(database_url: str, job_ids: list[str]) -> collections.Counter[str]:
    """Per job, the attempts requeued because a rank was killed from outside (a system
    fault: worker/run/outside_kill.py), not failed."""
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT job_id FROM job_events WHERE job_id = ANY(:ids) AND type = 'requeued' "
                "AND message LIKE '%killed from outside%'"), {"ids": job_ids}).all()
    finally:
        engine.dispose()
    return collections.Counter(r[0] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=120.0, help="how long faults go on")
    ap.add_argument("--drain", type=float, default=120.0,
                    help="how long jobs may take to end once the faults stop")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else secrets.randbelow(10_000)
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="ftune-faults-"))
    print(f"seed {seed}; logs under {tmp}", flush=True)

    redis = RedisServer(tmp / "redis").start()
    db = PgDatabase().create()
    model = tmp / "models" / "fake-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")  # the fake trainer reads no weights
    stack = FaultStack(data_dir=tmp / "data", workers=args.workers, env_overrides={
        "DATABASE_URL": db.url, "BROKER_URL": redis.url, "FTUNE_QUEUE_NAME": QUEUE,
        "FTUNE_ALLOWED_MODEL_ROOTS": str(model.parent),
        "FTUNE_TRAINER_MODULE": "testkit.fake_trainer", "FTUNE_WORKER_GPUS": "0",
        "FTUNE_HEARTBEAT_SECONDS": "0.5", "FTUNE_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT),
        "FTUNE_RECONCILE_INTERVAL_SECONDS": "1", "FTUNE_QUEUED_REQUEUE_SECONDS": "5",
        "FTUNE_CANCEL_GRACE_SECONDS": str(GRACE), "FTUNE_MAX_ATTEMPTS": "3",
        "FTUNE_JOBS_PER_MINUTE_PER_TENANT": "100000",
    })
    watcher = LaunchWatcher()
    started = time.monotonic()
    try:
        stack.start()
        c = FtuneClient(stack.url, stack.api_key)
        data = tmp / "train.jsonl"
        data.write_text("".join(json.dumps({"text": f"row {i} of the soak"}) + "\n"
                                for i in range(16)))
        file_id = c.upload_file(data)["id"]
        watcher.start()
        job_ids = []
        for i, (mode, extra) in enumerate(job_mix(rng, args.jobs)):
            spec = {"name": f"fake:{mode}:{i}", "model": {"name_or_path": str(model)},
                    "dataset": {"file_id": file_id, "format": "text"}, **extra}
            job_ids.append(c.create_job(spec)["id"])
        print(f"submitted {len(job_ids)} jobs; injecting faults for {args.seconds:g} s",
              flush=True)

        inj = Injector(stack, redis, c, rng, job_ids)
        fault_end = time.monotonic() + args.seconds
        next_fault = time.monotonic() + rng.uniform(1, 3)
        while time.monotonic() < fault_end:
            inj.restart_due()
            if time.monotonic() >= next_fault:
                inj.inject()
                next_fault = time.monotonic() + rng.uniform(1, 3)
                if not inj.active():
                    break
            time.sleep(0.1)
        for i in list(inj.restart_at):  # faults over: every worker back
            inj.restart_at[i] = 0
        inj.restart_due()
        print(f"faults over after {time.monotonic() - started:.0f} s; draining", flush=True)

        drain_end = time.monotonic() + args.drain
        jobs: dict[str, Job] = {}
        while time.monotonic() < drain_end:
            try:
                jobs = {j: c.get_job(j) for j in job_ids}
            except FtuneAPIError:
                jobs = {}
            if jobs and all(j["status"] in TERMINAL for j in jobs.values()):
                break
            time.sleep(1)
        time.sleep(GRACE + 1)  # anything a lost attempt left behind has been swept by now
        watcher.stop.set()
        watcher.join(5)
        orphans = sum(len(launch_processes(j)) for j in job_ids)
        dup_started, dup_claims, dup_list = count_duplicates(
            db.url, {j: int(job["attempt"]) for j, job in jobs.items()})
        killed = killed_and_requeued(db.url, job_ids)
        wall = time.monotonic() - started
    finally:
        watcher.stop.set()
        stack.stop()
        redis.stop()
        db.drop()

    statuses = collections.Counter(j["status"] for j in jobs.values())
    codes = collections.Counter(err["code"] for j in jobs.values()
                                if j["status"] == "failed" and (err := j.get("error")))
    lost = len(job_ids) - sum(n for s, n in statuses.items() if s in TERMINAL)
    attempts = collections.Counter(j["attempt"] for j in jobs.values())
    concurrent = len({v[0] for v in watcher.violations})
    print()
    print(f"faults injected:   {sum(inj.counts.values())}  "
          + ", ".join(f"{k} {v}" for k, v in sorted(inj.counts.items())))
    print(f"jobs submitted:    {len(job_ids)}")
    print(f"jobs terminal:     {sum(n for s, n in statuses.items() if s in TERMINAL)}  "
          + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
          + ("  (failed: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())) + ")"
             if codes else ""))
    print("attempts per job:  " + ", ".join(f"{k}: {v}" for k, v in sorted(attempts.items())))
    print(f"launches seen:     {len(watcher.launches)}")
    resumed = collections.Counter(jobs[j]["status"] for j in killed if j in jobs)
    print(f"killed ranks:      {sum(killed.values())} attempts requeued (a system fault) in "
          f"{len(killed)} jobs, which ended " + ", ".join(f"{k} {v}" for k, v in
                                                      sorted(resumed.items())))
    print(f"jobs lost:         {lost}")
    print(f"duplicate runs:    {concurrent + dup_started + dup_claims}  (concurrent launches "
          f"{concurrent}, attempts with >1 started {dup_started}, attempts claimed twice "
          f"{dup_claims})")
    print(f"orphan processes:  {orphans}")
    print(f"wall time:         {wall:.0f} s")
    if watcher.violations:
        print("concurrent launches:", watcher.violations[:5])
    if dup_list:
        print("duplicate started:", dup_list[:5])
    if not args.keep and not (lost or concurrent or dup_started or dup_claims or orphans):
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if (lost or concurrent or dup_started or dup_claims or orphans) else 0


if __name__ == "__main__":
    sys.exit(main())
