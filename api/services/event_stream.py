"""GET /v1/jobs/{id}/events as server-sent events: the job's new events polled from the
database every SSE_POLL_SECONDS (each poll a short session taken under the API's database
slots, so an open stream holds no connection), a keepalive comment while nothing happens,
and an ``end`` event once the job has finished."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.sse import format_sse_event
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.schemas import EventObject
from api.services import jobs
from core.db.models import Job

SSE_POLL_SECONDS = 0.5
SSE_KEEPALIVE_SECONDS = 15.0


def _poll(
    maker: sessionmaker[Session], job_id: str, after: int | None
) -> tuple[str | None, list[EventObject]]:
    with maker() as session:
        # Status first: events written before a terminal status are then surely visible.
        status = session.scalar(select(Job.status).where(Job.id == job_id))
        rows = jobs.events_after(session, job_id, after, 500)
        return status, [jobs.event_object(e) for e in rows]


async def event_stream(
    maker: sessionmaker[Session], slots: asyncio.Semaphore, job_id: str, after: int | None
) -> AsyncIterator[bytes]:
    last_sent = time.monotonic()
    yield format_sse_event(retry=2000)
    while True:
        async with slots:
            status, events = await run_in_threadpool(_poll, maker, job_id, after)
        for e in events:
            after = e.id
            yield format_sse_event(event=e.type, data_str=e.model_dump_json(), id=str(e.id))
        if events:
            last_sent = time.monotonic()
            continue
        if status is None or jobs.is_terminal(status):
            yield format_sse_event(event="end", data_str=json.dumps({"status": status}))
            return
        if time.monotonic() - last_sent >= SSE_KEEPALIVE_SECONDS:
            yield format_sse_event(comment="keepalive")
            last_sent = time.monotonic()
        await asyncio.sleep(SSE_POLL_SECONDS)
