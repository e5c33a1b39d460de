"""A real uvicorn server on a free port, in a thread, per test module; httpx clients.

Each module gets its own data dir, its own migrated database (SQLite unless the module
overrides ``db_url``), a recording enqueue fake and two tenants (A from the bootstrap key, B
from ``create_api_key``)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from api.main import create_app
from api.services.keys import create_api_key
from core.db.migrate import upgrade_head
from core.db.models import GpuAllocation, Job, JobStatus, Worker
from core.db.session import make_engine
from core.infra.settings import Settings
from worker.upkeep.registry import Inventory, register


@dataclass
class RecordingEnqueue:
    """Stands in for core.jobs.dispatch.enqueue_job; reads the job on a separate connection,
    so it only sees it if it was committed before the call."""

    maker: sessionmaker[Session] | None = None
    calls: list[tuple[str, str | None]] = field(default_factory=list)
    fail: bool = False

    def __call__(self, job_id: str) -> None:
        assert self.maker is not None
        with self.maker() as session:
            status = session.scalar(select(Job.status).where(Job.id == job_id))
        self.calls.append((job_id, status))
        if self.fail:
            raise ConnectionError("broker down")


class ServerThread:
    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Api:
    url: str
    settings: Settings
    maker: sessionmaker[Session]
    enqueue: RecordingEnqueue
    key_a: str
    key_b: str
    roots: Path
    clients: list[httpx.Client] = field(default_factory=list)
    app: Any = None  # the FastAPI app served, for tests that look at its state

    def client(self, key: str | None = None) -> httpx.Client:
        """A client for ``key`` (none: unauthenticated), made once per module: building an
        httpx client loads the TLS certificates, which costs a noticeable fraction of a second."""
        for c in self.clients:
            if c.headers.get("authorization") == (f"Bearer {key}" if key else None):
                return c
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        c = httpx.Client(base_url=self.url, headers=headers, timeout=20)
        self.clients.append(c)
        return c

    def session(self) -> Session:
        return self.maker()


def migrated_sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A new SQLite database in a temp dir, migrated to head."""
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'ftune.db'}"
    upgrade_head(url)
    return url


@pytest.fixture(scope="module")
def db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return migrated_sqlite_url(tmp_path_factory)


@pytest.fixture(scope="module")
def fresh_pg_url() -> Iterator[str]:
    """A PostgreSQL database of this module's own (pg_url is shared by the session), for
    tests that read server-wide numbers such as /metrics."""
    from testkit.pg import migrated_database

    with migrated_database() as url:
        yield url


@pytest.fixture(scope="module")
def api_settings(tmp_path_factory: pytest.TempPathFactory, db_url: str) -> Settings:
    root = tmp_path_factory.mktemp("ftune")
    models, data = root / "models", root / "data-root"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text("{}")
    (models / "no-config").mkdir()
    data.mkdir()
    return Settings(
        data_dir=root / "data",
        DATABASE_URL=db_url,
        BROKER_URL="filesystem://",
        allowed_model_roots=[models],
        allowed_data_roots=[data],
        bootstrap_api_key="ft_bootstrap_" + secrets.token_hex(8),
        max_upload_bytes=64 * 1024,
        jobs_per_minute_per_tenant=1000,
    )


@pytest.fixture(scope="module")
def api(api_settings: Settings, db_url: str) -> Iterator[Api]:
    engine = make_engine(db_url)
    maker = sessionmaker(bind=engine, expire_on_commit=False)
    enqueue = RecordingEnqueue(maker)
    app = create_app(api_settings, enqueue=enqueue)
    with ServerThread(app) as url:
        with maker.begin() as session:
            key_b = create_api_key(session, f"tenant-b-{secrets.token_hex(3)}", "tests")
        assert api_settings.bootstrap_api_key is not None
        a = Api(
            url,
            api_settings,
            maker,
            enqueue,
            api_settings.bootstrap_api_key,
            key_b,
            api_settings.allowed_model_roots[0].parent,
            app=app,
        )
        yield a
        for c in a.clients:
            c.close()
    engine.dispose()


@pytest.fixture
def client_a(api: Api) -> httpx.Client:
    return api.client(api.key_a)


@pytest.fixture
def client_b(api: Api) -> httpx.Client:
    return api.client(api.key_b)


def set_step(db: Any, job_id: str, step: int) -> None:
    """A commit that moves a job's progress, as the worker's monitor writes it: ``db`` is an
    engine or a sessionmaker (the API's own, or another process's stand-in)."""
    with db.begin() as c:
        c.execute(update(Job).where(Job.id == job_id).values(step=step))


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client: httpx.Client, name: str, content: bytes) -> httpx.Response:
    return client.post("/v1/files", files={"file": (name, content, "application/octet-stream")})


def upload_rows(client: httpx.Client, rows: list[dict[str, Any]], name: str = "d.jsonl") -> str:
    r = upload(client, name, jsonl(rows))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def job_body(file_id: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name_or_path": "org/tiny-model"},
        "dataset": {"file_id": file_id, "format": "text"},
        "training": {"max_steps": 10},
    }
    body.update(overrides)
    return body


TEXT_ROWS = [{"text": f"sentence number {i}"} for i in range(8)]


@pytest.fixture
def fleet(api: Api) -> Iterator[Callable[..., None]]:
    """Register workers for one test: ``fleet("node-1", gpus=2, **capabilities)`` (0 GPUs: a
    CPU-only worker). Afterwards the workers, their GPU allocations and the jobs still queued
    are gone, so the next test's admission sees an empty fleet."""
    def add(wid: str, gpus: int = 0, **caps: Any) -> None:
        inv = Inventory("node", [{"index": i, "name": "H100", "memory_mb": 81559}
                                 for i in range(gpus)], 16,
                        {"cuda": gpus > 0, "bf16": gpus > 0, "max_machines": 1, **caps},
                        max(1, gpus))
        with api.maker.begin() as s:
            register(s, wid, inv)

    yield add
    with api.maker.begin() as s:
        s.execute(delete(GpuAllocation))
        s.execute(update(Job).where(Job.status == JobStatus.queued)
                  .values(status=JobStatus.cancelled))
        s.execute(delete(Worker))
