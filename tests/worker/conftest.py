"""Worker test fixtures: settings pointed at a temp data dir and a chosen database (SQLite
per test, or the session's PostgreSQL), the fake trainer run directly. The factories they
serve are in tests/utils/worker.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.utils.worker import FAKE_TRAINER, WorkerEnv, configure_worker, teardown_worker


@pytest.fixture
def wenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> Iterator[WorkerEnv]:
    """SQLite (fresh per test) + filesystem broker + the fake trainer."""
    yield configure_worker(monkeypatch, tmp_path, sqlite_url)
    teardown_worker()


@pytest.fixture
def pg_wenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> Iterator[WorkerEnv]:
    """The session's PostgreSQL database (shared: tests only look at their own jobs)."""
    yield configure_worker(monkeypatch, tmp_path, pg_url)
    teardown_worker()


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the fake trainer without `accelerate launch` (saves ~3 s of torch import per run)
    where the launcher is not what a test is about."""
    import sys

    import worker.run.prepare

    monkeypatch.setattr(worker.run.prepare, "_trainer_argv",
                        lambda job_dir, port: [sys.executable, "-m", FAKE_TRAINER, str(job_dir)])


@pytest.fixture
def configure(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., WorkerEnv]]:
    """Re-point the settings (e.g. at Redis) inside a test."""

    def _do(tmp: Path, db_url: str, **overrides: str) -> WorkerEnv:
        return configure_worker(monkeypatch, tmp, db_url, **overrides)

    yield _do
    teardown_worker()
