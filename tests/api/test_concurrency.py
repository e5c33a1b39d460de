"""More concurrent requests than the database pool has connections (SQLite's pool: 5 + 10
overflow): they queue for a slot instead of stalling the server until the pool times out,
and live event streams hold no connection while they wait for events."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import update

from core.db.models import Job
from testkit.wait import wait_until
from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


def test_many_concurrent_requests_all_complete(api: Api, client_a: httpx.Client) -> None:
    job_id = client_a.post("/v1/jobs", json=job_body(upload_rows(client_a, TEXT_ROWS))).json()["id"]
    headers = {"Authorization": f"Bearer {api.key_a}"}
    tls = ssl.create_default_context()  # one for all: building one per client is slow
    barrier = threading.Barrier(60)

    def get(_: int) -> tuple[int, float]:
        with httpx.Client(base_url=api.url, headers=headers, timeout=25, verify=tls) as c:
            c.get("/healthz")  # connected before the barrier: 60 requests at the same moment
            barrier.wait()
            t0 = time.monotonic()
            return c.get(f"/v1/jobs/{job_id}").status_code, time.monotonic() - t0

    with ThreadPoolExecutor(60) as pool:
        results = list(pool.map(get, range(60)))
    assert [s for s, _ in results] == [200] * 60
    assert max(t for _, t in results) < 15  # the pool's 30 s timeout was never waited out


def test_event_streams_do_not_hold_database_connections(api: Api, client_a: httpx.Client) -> None:
    job_id = client_a.post("/v1/jobs", json=job_body(upload_rows(client_a, TEXT_ROWS))).json()["id"]
    fake_run(api, job_id, status="running")  # its stream stays open
    headers = {"Authorization": f"Bearer {api.key_a}", "Accept": "text/event-stream"}
    started = threading.Semaphore(0)
    stop = threading.Event()

    def listen() -> None:
        with (
            httpx.Client(base_url=api.url, headers=headers, timeout=25) as c,
            c.stream("GET", f"/v1/jobs/{job_id}/events") as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: started"):
                    started.release()
                if stop.is_set():
                    return

    threads = [threading.Thread(target=listen, daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert started.acquire(timeout=20), "a stream did not start"
        t0 = time.monotonic()
        for _ in range(5):
            assert client_a.get(f"/v1/jobs/{job_id}").status_code == 200
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        with api.session() as s:  # ends every stream
            s.execute(update(Job).where(Job.id == job_id).values(status="succeeded"))
            s.commit()
        for t in threads:
            t.join(10)


def test_uploads_in_progress_do_not_hold_database_connections(
    api: Api, client_a: httpx.Client
) -> None:
    """20 uploads stalled mid-body (more than the pool's 15 connections)."""
    host, port = api.url.removeprefix("http://").split(":")
    head = (
        "POST /v1/files HTTP/1.1\r\n"
        f"Host: {host}\r\nAuthorization: Bearer {api.key_a}\r\n"
        "Content-Type: multipart/form-data; boundary=XyZ\r\nContent-Length: 50000\r\n\r\n"
        '--XyZ\r\nContent-Disposition: form-data; name="file"; filename="d.jsonl"\r\n\r\n'
        '{"text": "a"}\n'
    ).encode()
    stalled = []

    def uploads_on_disk() -> int:
        return sum(1 for p in api.settings.uploads_dir.rglob("*") if p.is_file())

    before = uploads_on_disk()
    try:
        for _ in range(20):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(head)
            stalled.append(s)
        # Every upload authenticated and is waiting for its body: its file is open.
        wait_until(lambda: uploads_on_disk() == before + 20, 20, "20 uploads to open their file",
                   every=0.02)
        t0 = time.monotonic()
        for _ in range(3):
            assert client_a.get("/v1/files").status_code == 200
        assert time.monotonic() - t0 < 10
    finally:
        for s in stalled:
            s.close()
