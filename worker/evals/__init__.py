"""Eval runs on a worker: the Celery task's body (core/evals/execute.py does the work)."""

from __future__ import annotations

from core.db.session import get_sessionmaker
from core.evals.execute import execute_run
from core.infra.settings import get_settings
from worker.run.claim import worker_identity


def run_eval(run_id: str) -> str:
    settings = get_settings()
    return execute_run(get_sessionmaker(), run_id, worker_id=worker_identity(settings),
                       settings=settings)
