"""Enqueue a job for the workers. Called by the API (after the job row is committed) and by
the reconciler. Light on purpose: Celery and the settings only, never torch, and never
``worker.queue.celery_app`` (the worker's own app and signal handlers)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

from celery import Celery
from sqlalchemy.orm import Session

from core.db.session import after_commit
from core.infra.broker import RUN_JOB_TASK, create_app, ensure_broker_dirs
from core.infra.settings import get_settings

log = logging.getLogger(__name__)

_lock = threading.Lock()
_producers: dict[tuple[str, str, str], Celery] = {}


def _producer() -> Celery:
    # Keyed by what a message depends on, so tests and the CLI that change the settings get
    # a producer for the new broker instead of a stale one.
    settings = get_settings()
    assert settings.broker_url is not None
    key = (settings.broker_url, str(settings.broker_dir), settings.queue_name)
    with _lock:
        app = _producers.get(key)
        if app is None:
            ensure_broker_dirs(settings)
            app = _producers[key] = create_app(settings, include_tasks=False)
        return app


def enqueue_job(job_id: str) -> None:
    """Tell the workers that job ``job_id`` is ready. The message carries only the id; a
    duplicate is harmless (the worker claims the job with a guarded UPDATE)."""
    queue = get_settings().queue_name
    _producer().send_task(RUN_JOB_TASK, args=[job_id], queue=queue)
    log.info("enqueued job %s on %s", job_id, queue)


def send_task(name: str, args: list[str]) -> None:
    """Any other task of the workers' queue (an eval run: core/evals/dispatch.py)."""
    _producer().send_task(name, args=args, queue=get_settings().queue_name)


def enqueue_after_commit(session: Session, job_id: str,
                         enqueue: Callable[[str], None] | None = None) -> None:
    """Enqueue ``job_id`` once ``session`` commits, never if it rolls back (the one way the
    API, the worker's requeue and the reconciler send a job). A broker failure is logged,
    not raised: the job stays queued and the reconciler sends it again, so a lost message
    only delays it. ``enqueue``: another sender (the API's, in tests)."""

    def send() -> None:
        try:
            (enqueue or enqueue_job)(job_id)
        except Exception:
            log.exception("could not enqueue job %s; the reconciler will retry", job_id,
                          extra={"job_id": job_id})

    after_commit(session, send)


def worker_queue(queue: str, worker_id: str) -> str:
    """The queue only worker ``worker_id`` consumes (beside the shared one): doorbells for a
    worker the scheduler found room on (core/jobs/scheduler.py ``workers_with_work``)."""
    return f"{queue}.worker.{re.sub(r'[^A-Za-z0-9_.-]', '_', worker_id)}"


def ring_worker(worker_id: str) -> None:
    """"Look now" for one worker: it makes a scheduling decision for its free GPUs. The
    message names no job (the database decides which); a duplicate is harmless."""
    queue = worker_queue(get_settings().queue_name, worker_id)
    _producer().send_task(RUN_JOB_TASK, args=[""], queue=queue)
    log.debug("rang worker %s on %s", worker_id, queue)


def reset_producers() -> None:
    """Close and forget the cached producers (tests; the CLI after changing settings)."""
    with _lock:
        apps = list(_producers.values())
        _producers.clear()
    for app in apps:
        app.close()
