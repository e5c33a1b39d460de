"""The API server process: what start-up loaded is frozen out of the garbage collector's full
passes (they paused the event loop for tens of milliseconds about once a second under load);
an app built for tests or embedding leaves the collector alone."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from core.infra.settings import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", DATABASE_URL=f"sqlite:///{tmp_path / 'db'}",
                    BROKER_URL="filesystem://")


@pytest.fixture
def collector_and_logging_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    gc.unfreeze()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_server_process_freezes_what_start_up_loaded(
    settings: Settings, collector_and_logging_restored: None
) -> None:
    gc.unfreeze()
    with TestClient(create_app(settings, server_process=True)) as client:
        assert client.get("/healthz").status_code == 200
        # Every module, the app and the engine: well over what a bare interpreter holds.
        assert gc.get_freeze_count() > 50_000


def test_an_app_for_tests_leaves_the_collector_alone(
    settings: Settings, collector_and_logging_restored: None
) -> None:
    gc.unfreeze()
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        assert gc.get_freeze_count() == 0
