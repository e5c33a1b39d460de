"""How long a run may hold its hardware: the job's time limit, and the deadline the worker
enforces (worker/run/watch.py asks the trainer to stop there and kills whatever is left after
``cancel_grace_seconds``). The scheduler reads the same deadline as the latest moment a
running job's GPUs come free (core/jobs/scheduler.py, backfill around a reservation).

Pure: a spec, settings values and times in, a number out."""

from __future__ import annotations

from core.spec import JobSpec


def time_limit(spec: JobSpec, default_seconds: int | None) -> int | None:
    """Seconds a run of ``spec`` may take (its own ``resources.timeout_seconds``, else the
    operator's default), or None: no limit."""
    return spec.resources.timeout_seconds or default_seconds


def run_deadline(started_at: float, paused_seconds: float, limit: int | None) -> float | None:
    """The epoch second past which the run is stopped: the limit counts from the job's first
    start, minus the time it spent paused. None: no limit."""
    if not limit:
        return None
    return started_at + paused_seconds + limit
