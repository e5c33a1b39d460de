"""A real Celery worker process (solo pool) on the real Redis and PostgreSQL, running the fake
trainer under `accelerate launch` (FTUNE_TRAINER_MODULE=testkit.fake_trainer)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from core.db.models import JobStatus, WorkerState, utcnow
from core.db.models import Worker as WorkerRow
from core.db.session import session_scope
from core.infra.cpu_priority import autogroup_nice
from core.jobs.dispatch import enqueue_job
from core.run.jobdir import JobDir
from testkit.launch import REPO_ROOT
from testkit.pg import migrated_database
from testkit.wait import wait_until
from tests.utils.services import REDIS_URL
from tests.utils.worker import (
    WorkerEnv,
    events_of,
    fake_job,
    get_job,
    set_job,
    statuses,
    subprocess_env,
)
from worker.run import process_tree

pytestmark = pytest.mark.e2e


def _redis():  # type: ignore[no-untyped-def]
    import redis

    return redis.Redis.from_url(REDIS_URL)


@pytest.fixture
def queue() -> Iterator[str]:
    name = f"ftune-test-{secrets.token_hex(4)}"
    # Redis runs wherever the suite runs (FTUNE_TEST_REDIS_URL): no Redis is a failure here.
    _redis().ping()
    yield name
    _redis().delete(name)


@pytest.fixture(scope="module")
def own_pg_url() -> Iterator[str]:
    """A database of this module's own: a worker runs whatever the scheduler picks from the
    whole queue, so jobs other tests left queued must not be in it."""
    with migrated_database() as url:
        yield url


@pytest.fixture
def celery_env(tmp_path: Path, own_pg_url: str, queue: str,
               configure: Callable[..., WorkerEnv]) -> Iterator[WorkerEnv]:
    w = configure(tmp_path, own_pg_url, BROKER_URL=REDIS_URL, FTUNE_QUEUE_NAME=queue,
                  # This worker must not reconcile jobs of the other tests of this module.
                  FTUNE_RECONCILE_INTERVAL_SECONDS="3600")
    yield w
    from core.jobs.dispatch import reset_producers

    reset_producers()


class Worker:
    def __init__(self, w: WorkerEnv, queue: str) -> None:
        self.log = w.tmp / "celery-worker.log"
        argv = [sys.executable, "-m", "celery", "-A", "worker.queue.celery_app", "worker",
                "--pool=solo", "--concurrency=1", "-Q", queue, "-n", f"{queue}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
                "--loglevel=INFO"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=subprocess_env(w.env),
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.wait_for_log(" ready.", 60)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, needle: str, timeout: float) -> None:
        try:
            wait_until(lambda: needle in self.text(), timeout, f"the worker to log {needle!r}",
                       every=0.1, give_up=lambda: self.proc.poll() is not None and "it exited")
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{self.text()[-4000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture
def worker(celery_env: WorkerEnv, queue: str) -> Iterator[Worker]:
    wk = Worker(celery_env, queue)
    yield wk
    wk.stop()


def _wait(cond: Callable[[], bool], timeout: float, what: str, wk: Worker) -> None:
    try:
        wait_until(cond, timeout, what, every=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}:\n{wk.text()[-4000:]}") from None


# Claim, launch and three steps of a trainer at nice 7: a minute or more on a loaded 2-core
# machine. A bound, not a measure: the wait returns as soon as the job trains.
TO_TRAIN = 180


def _training(job_id: str, jd: JobDir) -> bool:
    job = get_job(job_id)
    return job.status == JobStatus.running and job.step >= 3 and \
        (jd.root / "grandchildren.txt").exists() and (jd.root / "pids.json").exists() and \
        len(json.loads((jd.root / "pids.json").read_text())["tree"]) == 3


def _assert_no_process_left(job_id: str, jd: JobDir) -> None:
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
    pids = json.loads((jd.root / "pids.json").read_text())
    for pid in [pids["trainer"], *pids["tree"]]:
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_cancel_mid_run_through_a_real_worker(celery_env: WorkerEnv, worker: Worker) -> None:
    job_id = fake_job(celery_env, "slow")
    jd = JobDir(celery_env.settings.jobs_dir / job_id)

    enqueue_job(job_id)
    _wait(lambda: _training(job_id, jd), TO_TRAIN, "the job to train", worker)
    # What POST /v1/jobs/{id}/cancel does to a running job.
    set_job(job_id, status=JobStatus.cancelling, cancel_requested_at=utcnow())
    _wait(lambda: get_job(job_id).status == JobStatus.cancelled, 30, "cancelled", worker)

    job = get_job(job_id)
    assert job.finished_at is not None and job.attempt == 1
    assert statuses(job_id) == ["running", "cancelling", "cancelled"] or \
        statuses(job_id) == ["running", "cancelled"]
    assert events_of(job_id, "stopped"), "graceful stop first"
    _assert_no_process_left(job_id, jd)
    assert worker.proc.poll() is None, "the worker goes on serving"


def test_warm_shutdown_requeues_the_job(celery_env: WorkerEnv, worker: Worker,
                                        queue: str) -> None:
    job_id = fake_job(celery_env, "slow")
    jd = JobDir(celery_env.settings.jobs_dir / job_id)
    enqueue_job(job_id)
    _wait(lambda: _training(job_id, jd), TO_TRAIN, "the job to train", worker)

    worker.proc.send_signal(signal.SIGTERM)  # docker stop, systemctl stop, Ctrl-C
    worker.proc.wait(30)

    job = get_job(job_id)
    assert (job.status, job.worker_id, job.attempt) == (JobStatus.queued, None, 1)
    assert [e.message for e in events_of(job_id, "requeued")] == ["the worker shut down"]
    _assert_no_process_left(job_id, jd)
    # Its message was acked when the run started; the worker sent a new one on the way out.
    assert _redis().llen(queue) == 1
    # A clean stop is not a loss: the fleet (GET /v1/workers, the dashboard) says so.
    with session_scope() as s:
        states = set(s.scalars(select(WorkerRow.state)))
    assert states == {WorkerState.stopped}


def test_the_worker_and_its_trainers_run_at_the_configured_nice(
    tmp_path: Path, own_pg_url: str, queue: str, configure: Callable[..., WorkerEnv]
) -> None:
    # `ftune up` sets FTUNE_WORKER_NICE so that a trainer on every core yields to the API.
    env = configure(tmp_path, own_pg_url, BROKER_URL=REDIS_URL, FTUNE_QUEUE_NAME=queue,
                    FTUNE_RECONCILE_INTERVAL_SECONDS="3600", FTUNE_WORKER_NICE="7")
    wk = Worker(env, queue)
    try:
        job_id = fake_job(env, "slow")
        jd = JobDir(env.settings.jobs_dir / job_id)
        enqueue_job(job_id)
        _wait(lambda: _training(job_id, jd), TO_TRAIN, "the job to train", wk)

        # Every thread of the worker (the pool's, the heartbeat's), and the launched tree.
        worker_threads = [psutil.Process(t.id) for t in psutil.Process(wk.proc.pid).threads()]
        pids = json.loads((jd.root / "pids.json").read_text())
        tree = [psutil.Process(p) for p in [pids["trainer"], *pids["tree"]]]
        assert {p.nice() for p in worker_threads + tree} == {7}
        # The launch leads a session of its own: that session (its autogroup) yields too.
        # (The fake trainer's own setsid() grandchild is a session the worker never saw.)
        assert autogroup_nice(pids["trainer"]) == 7
        assert autogroup_nice(wk.proc.pid) == 7
        set_job(job_id, status=JobStatus.cancelling, cancel_requested_at=utcnow())
        _wait(lambda: get_job(job_id).status == JobStatus.cancelled, 30, "cancelled", wk)
    finally:
        wk.stop()
