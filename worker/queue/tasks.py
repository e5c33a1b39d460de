"""Celery tasks. They take ids, not objects; the runner re-loads everything from the DB."""

from __future__ import annotations

from core.infra.broker import RECONCILE_TASK, RUN_EVAL_TASK, RUN_JOB_TASK
from worker.queue.celery_app import app


@app.task(name=RUN_JOB_TASK, ignore_result=True, acks_late=False)
def run_job(job_id: str) -> str:
    """A doorbell: claim the job the scheduler picks for this worker's free GPUs (``job_id``
    is only the job whose submission rang; "" from a worker-to-worker ring), run and finish
    it. Nothing to run returns RunOutcome.skipped ("skipped")."""
    from worker.run.executor import run_job as _run_job

    return _run_job(job_id)


@app.task(name=RUN_EVAL_TASK, ignore_result=True, acks_late=False)
def run_eval(run_id: str) -> str:
    """Claim eval run ``run_id`` (queued, or abandoned by a worker that died: it resumes),
    generate and grade its items. A duplicate delivery finds it claimed: "skipped"."""
    from worker.evals import run_eval as _run_eval

    return _run_eval(run_id)


@app.task(name=RECONCILE_TASK, ignore_result=True, acks_late=False)
def reconcile() -> dict[str, int]:
    """For celery beat users; each worker also runs the reconciler in a thread."""
    from worker.upkeep.reconciler import reconcile as _reconcile

    return _reconcile()
