"""Telling the workers that an eval run is ready: the message carries only the run id; a
duplicate is harmless (the worker claims the run with a guarded UPDATE)."""

from __future__ import annotations

import logging

from core.db.session import session_scope
from core.evals import store
from core.infra.broker import RUN_EVAL_TASK
from core.jobs.dispatch import send_task

log = logging.getLogger(__name__)


def enqueue_run(run_id: str) -> None:
    send_task(RUN_EVAL_TASK, [run_id])
    log.info("enqueued eval run %s", run_id)


def resend_stale_runs(stale_seconds: float) -> int:
    """Send again the runs no worker holds alive (queued too long, or whose worker stopped
    heart-beating): whichever worker takes one resumes it. A reconciler pass."""
    with session_scope() as session:
        run_ids = store.stale_runs(session, stale_seconds)
    for run_id in run_ids:
        try:
            enqueue_run(run_id)
        except Exception:
            log.exception("could not enqueue eval run %s; the next pass retries", run_id)
    return len(run_ids)
