"""Readiness: can this API reach the database and the broker?"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.infra.broker import filesystem_folders
from core.infra.settings import Settings

log = logging.getLogger("ftune.api")


def check_database(maker: sessionmaker[Session]) -> str | None:
    try:
        with maker() as session:
            session.execute(text("SELECT 1"))
    except Exception as e:  # noqa: BLE001 - any failure means not ready
        log.warning("readyz: database check failed: %s", e)
        return f"unreachable ({type(e).__name__})"
    return None


def broker_folders(settings: Settings) -> list[Path]:
    return sorted(set(filesystem_folders(settings).values()))


def ensure_broker_folders(settings: Settings) -> None:
    if str(settings.broker_url).startswith("filesystem://"):
        for folder in broker_folders(settings):
            folder.mkdir(parents=True, exist_ok=True)


def check_broker(settings: Settings) -> str | None:
    url = str(settings.broker_url)
    if url.startswith("filesystem://"):
        for folder in broker_folders(settings):
            try:
                with tempfile.NamedTemporaryFile(dir=folder, prefix=".readyz-"):
                    pass
            except OSError as e:
                log.warning("readyz: broker folder %s: %s", folder, e)
                return f"folder {folder.name!r} is not writable"
        return None
    if url.startswith(("redis://", "rediss://", "redis+socket://")):
        try:
            import redis

            client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
            try:
                client.ping()
            finally:
                client.close()
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            log.warning("readyz: broker check failed: %s", e)
            return f"unreachable ({type(e).__name__})"
        return None
    return None  # another transport: not checked here


def readiness(maker: sessionmaker[Session], settings: Settings) -> dict[str, str]:
    checks = {}
    for name, problem in (("database", check_database(maker)), ("broker", check_broker(settings))):
        checks[name] = problem or "ok"
    return checks
