"""The API as its own process for the bench scripts: uvicorn serving api.main:app on a free
loopback port, a temporary data dir, a migrated database (SQLite there, or a fresh database
created on a given PostgreSQL server and dropped afterwards), the filesystem broker (nothing
consumes it: it only records what was enqueued) and a bootstrap API key."""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from cli.embedded import api_argv
from core.db.migrate import upgrade_head
from core.infra.ports import free_port
from testkit.pg import migrated_database

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunningApi:
    url: str
    key: str
    database_url: str
    data_dir: Path
    log_path: Path
    pid: int = 0


@contextmanager
def scratch_database(server_url: str | None, data_dir: Path) -> Iterator[str]:
    """SQLite under ``data_dir``, or a new database on the PostgreSQL server of
    ``server_url`` (dropped on exit)."""
    if server_url is None or server_url.startswith("sqlite"):
        url = server_url or f"sqlite:///{data_dir / 'ftune.db'}"
        upgrade_head(url)
        yield url
        return
    with migrated_database("ftune_bench", server_url) as url:
        yield url


@contextmanager
def running_api(
    database_url: str | None = None,
    *,
    log_level: str = "INFO",
    extra_env: dict[str, str] | None = None,
    cpus: str | None = None,
    loop: str = "asyncio",
) -> Iterator[RunningApi]:
    """``cpus``: pin the server to these CPUs (``taskset -c``), e.g. to keep a load
    generator off them; ``loop``: uvicorn's event loop (``api_argv``)."""
    with tempfile.TemporaryDirectory(prefix="ftune-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        with scratch_database(database_url, data_dir) as db_url:
            key = "ft_bench_" + secrets.token_urlsafe(24)
            port = free_port()
            env = {
                **os.environ,
                "FTUNE_DATA_DIR": str(data_dir),
                "DATABASE_URL": db_url,
                "BROKER_URL": "filesystem://",
                "FTUNE_BOOTSTRAP_API_KEY": key,
                "FTUNE_JOBS_PER_MINUTE_PER_TENANT": "1000000",
                "FTUNE_LOG_LEVEL": log_level,
                **(extra_env or {}),
            }
            log_path = Path(tmp) / "api.log"
            argv = api_argv("127.0.0.1", port, loop=loop)  # as `ftune api` and `ftune up` do
            if cpus is not None:
                argv = ["taskset", "-c", cpus, *argv]
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_ready(url, proc, log_path)
                yield RunningApi(url, key, db_url, data_dir, log_path, proc.pid)
            finally:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the API did not become ready in 60 s")
