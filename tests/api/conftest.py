"""A real uvicorn server on a free port, in a thread, per test module; httpx clients.

Each module gets its own data dir, its own migrated database (SQLite unless the module
overrides ``db_url``), a recording enqueue fake and two tenants (A from the bootstrap key, B
from ``create_api_key``). The dashboard's modules also get headless Chromium (``browser``,
one per module) and a fresh ``page`` per test."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, update
from sqlalchemy.orm import sessionmaker

from api.main import create_app
from api.services.keys import create_api_key
from core.db.models import GpuAllocation, Job, JobStatus, Worker
from core.db.session import make_engine
from core.infra.settings import Settings
from tests.utils.api import Api, RecordingEnqueue, ServerThread, migrated_sqlite_url
from tests.utils.browser import CHROMIUM, CHROMIUM_FLAGS
from worker.upkeep.registry import Inventory, register


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


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(
            "/usr/bin/chromium is missing: `apt-get install -y chromium` (make test does it "
            "when it runs as root)"
        )
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="ftune-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,  # a fresh --user-data-dir
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 1000},
            accept_downloads=True,
        )
        context.set_default_timeout(15_000)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    page = browser.new_page()
    page.problems = []  # CSP violations and uncaught script errors
    page.on(
        "console",
        lambda m: (
            page.problems.append(m.text)
            if m.type == "error" and "Content Security Policy" in m.text
            else None
        ),
    )
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    yield page
    page.close()
