"""The API under test, served for real: a uvicorn server in a thread, the recording enqueue
that stands in for the broker, and the requests most API tests make (an upload, a job body).
The fixtures that serve it per module are in tests/api/conftest.py."""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import Job
from core.db.session import make_engine
from core.infra.settings import Settings
from testkit.pg import migrated_database
from testkit.wait import wait_until
from tests.utils.specs import spec_body
from tests.utils.sqlite import sqlite_at_head


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
        wait_until(lambda: self.server.started, 20, "uvicorn to start", every=0.01,
                   give_up=lambda: None if self.thread.is_alive() else "its thread ended")
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
    return sqlite_at_head(tmp_path_factory.mktemp("db") / "ftune.db")


@contextlib.contextmanager
def migrated_sessionmaker(dialect: str, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[sessionmaker[Session]]:
    """Sessions on a new database migrated to head: SQLite in a temp dir, or a PostgreSQL
    database of its own (``dialect`` "sqlite" or "postgresql"), disposed of at exit."""
    with contextlib.ExitStack() as stack:
        url = (migrated_sqlite_url(tmp_path_factory) if dialect == "sqlite"
               else stack.enter_context(migrated_database()))
        engine = make_engine(url)
        stack.callback(engine.dispose)
        yield sessionmaker(bind=engine, expire_on_commit=False)


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
    """A request body for POST /v1/jobs on an uploaded text file; ``overrides`` replace whole
    sections."""
    return spec_body("org/tiny-model", dataset={"file_id": file_id, "format": "text"},
                     training={"max_steps": 10}) | overrides


TEXT_ROWS = [{"text": f"sentence number {i}"} for i in range(8)]


def one_model_settings(root: Path, db_url: str, model: str = "tiny") -> Settings:
    """An API's settings with ``model`` in its catalog (an empty folder: no engine can serve
    it, so inference stops at the 503 that says so) and a bootstrap key; a start of the
    serving wait short enough for tests of the answers before an engine."""
    (root / "models" / model).mkdir(parents=True)
    return Settings(
        data_dir=root / "data", DATABASE_URL=db_url, BROKER_URL="filesystem://",
        allowed_model_roots=[root / "models"],
        bootstrap_api_key="ft_bootstrap_" + secrets.token_hex(8),
        model_catalog={model: {"location": str(root / "models" / model)}},
        serving_start_wait_seconds=0.3,
    )
