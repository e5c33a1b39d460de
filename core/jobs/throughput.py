"""Tokens per wall second of this fleet's finished jobs, by model size: what the dry run
turns an estimate's token count into time and cost with."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass
class Throughput:
    tokens_per_second: float  # median over the jobs, wall time (load and save included)
    jobs: int


# Jobs count as "the same model size" when their base model's parameters are within this.
SIZE_TOLERANCE = 0.10
HISTORY_JOBS = 200


def throughput_history(session: Any, base_params: int, device: str | None = None) -> Throughput | None:
    """Tokens per wall second of succeeded jobs on this fleet whose base model has about
    ``base_params`` parameters (the latest HISTORY_JOBS of them); None without history."""
    from statistics import median

    from sqlalchemy import select

    from core.db.models import Job, JobStatus
    from core.jobs.usage import attempts_of, job_totals

    jobs = session.execute(
        select(Job.id, Job.run_info, Job.finished_at)
        .where(Job.status == JobStatus.succeeded, Job.run_info.is_not(None))
        .order_by(Job.finished_at.desc())
        .limit(HISTORY_JOBS)
    ).all()
    matching = []
    for job_id, info, finished in jobs:
        total, trainable = (info or {}).get("total_params"), (info or {}).get("trainable_params")
        if not isinstance(total, int) or not isinstance(trainable, int):
            continue
        if device is not None and info.get("device") not in (None, device):
            continue
        if abs((total - trainable) - base_params) <= SIZE_TOLERANCE * base_params:
            matching.append(job_id)
    rates = []
    for job_id, attempts in attempts_of(session, matching).items():
        ended = [a for a in attempts if a.ended_at is not None]
        totals = job_totals(ended, now=datetime.now(UTC))  # ended: `now` is not used
        if totals.tokens > 0 and totals.wall_seconds > 0:
            rates.append(totals.tokens / totals.wall_seconds)
    if not rates:
        return None
    return Throughput(tokens_per_second=float(median(rates)), jobs=len(rates))
