"""`ftune api`: the API server as the command starts it (several uvicorn processes behind one
port with --workers N; new connections served promptly while it is busy)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from core.db.migrate import upgrade_head
from core.infra.ports import free_port
from testkit.wait import wait_until


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@dataclass
class ApiCommand:
    proc: subprocess.Popen[bytes]
    port: int
    key: str


@contextmanager
def api_command(tmp_path: Path, *args: str) -> Iterator[ApiCommand]:
    """`ftune api --port P *args` on a migrated SQLite database with a bootstrap key, in a
    session of its own (its uvicorn workers are stopped with it)."""
    url = f"sqlite:///{tmp_path / 'ftune.db'}"
    upgrade_head(url)
    key, port = "ft_test_" + secrets.token_hex(8), free_port()
    env = {**os.environ, "DATABASE_URL": url, "BROKER_URL": "filesystem://",
           "FTUNE_DATA_DIR": str(tmp_path), "FTUNE_BOOTSTRAP_API_KEY": key}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "api", "--port", str(port),
                             *args], env=env, start_new_session=True)
    try:
        yield ApiCommand(proc, port, key)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_workers_option_serves_the_api_from_that_many_processes(tmp_path: Path) -> None:
    with api_command(tmp_path, "--workers", "2") as api:

        def served_by_two() -> httpx.Response | None:
            ok = httpx.get(f"http://127.0.0.1:{api.port}/v1/jobs",
                           headers={"Authorization": f"Bearer {api.key}"}, timeout=2)
            return ok if ok.status_code == 200 and len(_children(api.proc.pid)) >= 2 else None

        ok = wait_until(served_by_two, 60, "the API served by two processes",
                        ignore=(httpx.TransportError,))

        assert ok.status_code == 200
        assert ok.json()["data"] == []
        # uvicorn's workers are multiprocessing children of the command's process.
        cmdlines = [Path(f"/proc/{c}/cmdline").read_text() for c in _children(api.proc.pid)]
        assert sum("spawn_main" in c for c in cmdlines) == 2, cmdlines


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str,
               key: str) -> None:
    """One keep-alive GET on an open connection, read to the end of its body."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n\r\n"
                 .encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)


async def _new_connections_under_load(port: int, pid: int, key: str, busy: int,
                                      new: int) -> list[int]:
    """``busy`` connections poll GET /v1/jobs back to back; with the server stopped
    (SIGSTOP), ``new`` connections open and send a request each; the server continues.
    Returns, per new connection, how many of the busy connections' responses came between
    the server's continuing and its own first response."""
    served, stop = 0, asyncio.Event()

    async def poll() -> None:
        nonlocal served
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not stop.is_set():
            await _get(reader, writer, "/v1/jobs?limit=1", key)
            served += 1
        writer.close()

    pollers = [asyncio.create_task(poll()) for _ in range(busy)]
    while served < 5 * busy:  # every busy connection answered a few times
        await asyncio.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    try:
        fresh = [await asyncio.open_connection("127.0.0.1", port) for _ in range(new)]
        for _, writer in fresh:
            writer.write(f"GET /v1/jobs?limit=1 HTTP/1.1\r\nHost: t\r\n"
                         f"Authorization: Bearer {key}\r\n\r\n".encode())
            await writer.drain()
    finally:
        os.kill(pid, signal.SIGCONT)
    at_continue = served

    async def first_response(reader: asyncio.StreamReader) -> int:
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return served - at_continue

    waited = await asyncio.gather(*(first_response(r) for r, _ in fresh))
    stop.set()
    await asyncio.gather(*pollers)
    for _, writer in fresh:
        writer.close()
    return waited


def test_a_burst_of_new_connections_is_served_beside_a_busy_one(tmp_path: Path) -> None:
    # uvloop (uvicorn's default when installed) accepts one connection per turn of its loop
    # (libuv PR 3696): under load the last new connection waited 1,673 of the busy ones'
    # responses (~42 rounds; seconds at 100 connections). asyncio's loop, which `ftune api`
    # and `ftune up` run, accepts every pending connection in one turn: 81-107 here.
    with api_command(tmp_path) as api:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{api.port}/healthz", timeout=2)
                   .is_success, 60, "the API to answer", ignore=(httpx.TransportError,))
        busy = new = 40
        waited = asyncio.run(
            _new_connections_under_load(api.port, api.proc.pid, api.key, busy, new))
        # Each new connection answered within a few rounds of the busy ones (a round: every
        # busy connection answered once), not one turn of the loop after another.
        assert max(waited) <= 6 * busy, sorted(waited)


def test_an_ordinary_user_runs_python_graders_in_the_sandbox() -> None:
    """`ftune api` as the Docker image runs it (not root), python graders on: a grader runs
    in its sandbox, which sees neither the server's files nor its environment."""
    import json
    import shutil
    import tempfile

    from testkit.faultstack import http_ok
    from tests.utils.unprivileged import USER, as_user, give, python, user_env

    home = Path(tempfile.mkdtemp(prefix="ftune-user-"))  # not under root's private tmp
    home.chmod(0o755)
    url = f"sqlite:///{home / 'ftune.db'}"
    upgrade_head(url)
    give(home)
    key, port = "ft_test_" + secrets.token_hex(8), free_port()
    env = user_env(DATABASE_URL=url, BROKER_URL="filesystem://", FTUNE_DATA_DIR=str(home),
                   FTUNE_BOOTSTRAP_API_KEY=key, FTUNE_PYTHON_GRADERS="true",
                   FTUNE_GRADER_JUDGE_API_KEY="sk-judge")
    proc = subprocess.Popen(as_user([python(), "-m", "cli.main", "api", "--port", str(port)]),
                            env=env, cwd=Path(__file__).resolve().parents[2],
                            start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(base), 60, "the API started as an ordinary user")
        uid = next(line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))
        assert uid.split()[1] == str(USER)
        source = ("import os\ndef grade(sample, item):\n"
                  f"    if os.path.exists({str(home / 'ftune.db')!r}) or os.environ.get("
                  "'FTUNE_GRADER_JUDGE_API_KEY'):\n        return 1.0\n"
                  "    return 0.25 if os.getpid() < 10 else 0.0\n")
        r = httpx.post(f"{base}/v1/graders/run", headers={"Authorization": f"Bearer {key}"},
                       json={"grader": {"type": "python", "name": "py", "source": source},
                             "model_sample": "x"}, timeout=60)
        assert r.status_code == 200, r.text
        # Not the server's files, not its environment, a PID namespace of its own.
        assert r.json()["reward"] == 0.25, json.dumps(r.json())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)
