"""Where queued jobs stand: position and reason to wait, read from a snapshot of the
scheduler's view that each API process loads at most once per ``queue_snapshot_seconds``.

Loading that view (the workers, their allocations, the queue window of up to
``scheduler.QUEUE_WINDOW`` jobs with their specs) costs several times what the rest of a job
read does, and a dashboard polls every queued job: loaded per request it was a third of the
API's CPU under load. A position a second old tells a user what a fresh one does. A snapshot
is never used for a job queued after it was taken (a job just submitted is always placed)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from datetime import datetime
from time import monotonic

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from api.schemas import QueueInfo
from core.db.models import Job
from core.infra.settings import Settings
from core.jobs import queue_load, queue_wait, scheduler


@dataclass
class _Snapshot:
    state: scheduler.FleetState
    taken_at: datetime  # the database clock the state was read at (utcnow, as queued_at)
    loaded: float  # monotonic
    # Each job's answer, worked out once per snapshot: a dashboard polls the same jobs.
    answers: dict[str, scheduler.Waiting | None] = field(default_factory=dict)
    # What the fleet would start now (its reservation says who waits for GPUs): planned once
    # per snapshot, not once per job asked about.
    planned: scheduler.Plan | None = None


class QueueSnapshots:
    """One snapshot per database engine (an API process has one; a test process may have
    several apps on several databases), reloaded by one thread while the others wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_engine: weakref.WeakKeyDictionary[Engine, _Snapshot] = (
            weakref.WeakKeyDictionary()
        )

    def snapshot(self, session: Session, jobs: list[Job], settings: Settings,
                 now: datetime) -> _Snapshot:
        bind = session.get_bind()  # a Connection for reads on the event loop (LoopReads)
        engine = bind if isinstance(bind, Engine) else bind.engine
        newest = max(j.queued_at or j.created_at for j in jobs)
        with self._lock:
            snap = self._by_engine.get(engine)
            if (snap is None or snap.taken_at < newest
                    or monotonic() - snap.loaded >= settings.queue_snapshot_seconds):
                snap = _Snapshot(queue_load.load_state(session, settings, now), now, monotonic())
                self._by_engine[engine] = snap
            return snap


_SNAPSHOTS = QueueSnapshots()


def queue_infos(session: Session, queued: list[Job], settings: Settings,
                now: datetime) -> dict[str, QueueInfo]:
    """Position and reason to wait of queued jobs (core/jobs/scheduler.py ``waiting``)."""
    if not queued:
        return {}
    snap = _SNAPSHOTS.snapshot(session, queued, settings, now)
    out = {}
    for job in queued:
        if job.id not in snap.answers:
            if snap.planned is None:
                snap.planned = scheduler.plan(snap.state, settings, now)
            snap.answers[job.id] = queue_wait.waiting(snap.state, job.id, settings, now,
                                                     snap.planned)
        w = snap.answers[job.id]
        if w is not None:
            out[job.id] = QueueInfo(position=w.position, waiting_for=w.waiting_for,
                                    message=w.message)
    return out
