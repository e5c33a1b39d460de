"""`ftune api --workers N`: several uvicorn processes behind one port, each serving the API."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from core.db.migrate import upgrade_head
from core.net import free_port


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_workers_option_serves_the_api_from_that_many_processes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ftune.db'}"
    upgrade_head(url)
    key, port = "ft_test_" + secrets.token_hex(8), free_port()
    env = {**os.environ, "DATABASE_URL": url, "BROKER_URL": "filesystem://",
           "FTUNE_DATA_DIR": str(tmp_path), "FTUNE_BOOTSTRAP_API_KEY": key}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "api", "--port", str(port),
                             "--workers", "2"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/v1/jobs",
                               headers={"Authorization": f"Bearer {key}"}, timeout=2)
                if ok.status_code == 200 and len(_children(proc.pid)) >= 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

        assert ok.status_code == 200
        assert ok.json()["data"] == []
        # uvicorn's workers are multiprocessing children of the command's process.
        cmdlines = [Path(f"/proc/{c}/cmdline").read_text() for c in _children(proc.pid)]
        assert sum("spawn_main" in c for c in cmdlines) == 2, cmdlines
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
