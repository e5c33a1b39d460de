"""The services the suite uses for real, as this test process sees them."""

from __future__ import annotations

import os


def _redis_url_of_this_process(base: str, xdist_worker: str | None) -> str:
    """``make test`` runs files in parallel processes (pytest-xdist: gw0, gw1, ...). Queues are
    per test already, but Celery's broadcasts (control, events) reach every worker on a
    database: each process gets a database of its own, 8 apart (Redis has 16 by default)."""
    if not xdist_worker:
        return base
    from urllib.parse import urlsplit

    url = urlsplit(base)
    db = (int(url.path.strip("/") or 0) + 8 * int(xdist_worker.removeprefix("gw"))) % 16
    return url._replace(path=f"/{db}").geturl()


REDIS_URL = _redis_url_of_this_process(
    os.environ.get("FTUNE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    os.environ.get("PYTEST_XDIST_WORKER"),
)
