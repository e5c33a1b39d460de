"""One stack for every fault test (tests/utils/faults.py has its settings): the API and two
Celery workers as processes, a PostgreSQL database and a redis-server (no persistence) of
its own, short heartbeats. Workers run tests.worker.fault_trainer: the real core.train with a
fault injected (jobs named ``fault:<kind>``), or the fake trainer (jobs named
``fake:<mode>``). Package-scoped, and the package goes whole to one pytest-xdist worker (SAME_WORKER
in tests/conftest.py): built once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import FtuneClient
from testkit.faultstack import FaultStack, PgDatabase, RedisServer
from tests.utils.faults import (
    GRACE,
    HEARTBEAT_TIMEOUT,
    MAX_ATTEMPTS,
    QUEUE,
    RECONCILE_INTERVAL,
)
from tests.utils.tiny import text_rows, write_jsonl


@pytest.fixture(scope="package")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="package")
def database() -> Iterator[PgDatabase]:
    db = PgDatabase().create()
    yield db
    db.drop()


@pytest.fixture(scope="package")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("datasets")


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer,
          database: PgDatabase, models_dir: Path, tiny_causal_lm: Path,
          data_root: Path) -> Iterator[FaultStack]:
    st = FaultStack(
        data_dir=tmp_path_factory.mktemp("faults"),
        workers=2,
        env_overrides={
            "DATABASE_URL": database.url,
            "BROKER_URL": redis_server.url,
            "FTUNE_QUEUE_NAME": QUEUE,
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
            "FTUNE_ALLOWED_DATA_ROOTS": str(data_root),
            "FTUNE_TRAINER_MODULE": "tests.worker.fault_trainer",
            "FTUNE_WORKER_GPUS": "0",
            "FTUNE_HEARTBEAT_SECONDS": "0.5",
            "FTUNE_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT),
            "FTUNE_RECONCILE_INTERVAL_SECONDS": str(RECONCILE_INTERVAL),
            "FTUNE_QUEUED_REQUEUE_SECONDS": "3",
            "FTUNE_CANCEL_GRACE_SECONDS": str(GRACE),
            "FTUNE_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "FTUNE_JOBS_PER_MINUTE_PER_TENANT": "100000",
            # A visibility timeout far shorter than the runs, swept every second: a message
            # left unacked while its job runs would be delivered again within seconds.
            "FTUNE_BROKER_TRANSPORT_OPTIONS": json.dumps({
                "visibility_timeout": 2, "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1}),
        },
    )
    st.start()
    yield st
    st.stop()


@pytest.fixture
def client(stack: FaultStack) -> Iterator[FtuneClient]:
    # Restore what a failed test may have left down.
    for i in range(stack.workers):
        if stack.worker_pid(i) is None:
            stack.start_worker(i)
    with FtuneClient(stack.url, stack.api_key) as c:
        yield c


@pytest.fixture(scope="package")
def lm_file(stack: FaultStack, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = write_jsonl(tmp_path_factory.mktemp("upload") / "train.jsonl", text_rows(64))
    with FtuneClient(stack.url, stack.api_key) as c:
        return c.upload_file(path)["id"]
