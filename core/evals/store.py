"""An eval run's life in the database, the one writer of ``eval_runs.status``:

    queued -> in_progress -> completed | failed | canceled
    queued -> canceled (cancel before a worker took it)
    in_progress -> canceling -> canceled (the worker stops at its next heartbeat)

A worker claims a run with a guarded UPDATE (queued, or in_progress whose worker stopped
heart-beating: it died, and the run resumes), writes each output item as it is graded, and
heart-beats; every write after the claim is guarded by its worker id, so a worker that lost
its run (taken over after a stall) cannot finish it twice. Counts are summed from the
output items, which is why a resumed run reports exact totals."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

from sqlalchemy import case, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import EvalOutputItem, EvalRun, utcnow
from core.db.session import unit_of_work

QUEUED, RUNNING, CANCELING = "queued", "in_progress", "canceling"
COMPLETED, FAILED, CANCELED = "completed", "failed", "canceled"
UNFINISHED = (QUEUED, RUNNING, CANCELING)
FINISHED = (COMPLETED, FAILED, CANCELED)


class RunLost(RuntimeError):
    """This worker no longer holds the run (deleted, or taken over after a stall)."""


def claim(maker: sessionmaker[Session], run_id: str, worker_id: str,
          stale_seconds: float) -> bool:
    now = utcnow()
    with unit_of_work(maker) as session:
        res = session.execute(
            update(EvalRun)
            .where(EvalRun.id == run_id, or_(
                EvalRun.status == QUEUED,
                EvalRun.status.in_((RUNNING, CANCELING))
                & (EvalRun.heartbeat_at < now - timedelta(seconds=stale_seconds))))
            # A run taken over while canceling stays so: its new worker ends it at once.
            .values(status=case((EvalRun.status == CANCELING, CANCELING), else_=RUNNING),
                    worker_id=worker_id, attempt=EvalRun.attempt + 1,
                    heartbeat_at=now)
            .execution_options(synchronize_session=False))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            return False
        session.execute(update(EvalRun).where(EvalRun.id == run_id,
                                              EvalRun.started_at.is_(None))
                        .values(started_at=now).execution_options(synchronize_session=False))
    return True


def beat(maker: sessionmaker[Session], run_id: str, worker_id: str, *,
         generation_seconds: float = 0.0, grading_seconds: float = 0.0) -> bool:
    """Say the run lives (and add the seconds spent since the last beat); True if a cancel
    was asked. RunLost if this worker no longer holds it."""
    with unit_of_work(maker) as session:
        res = session.execute(
            update(EvalRun)
            .where(EvalRun.id == run_id, EvalRun.worker_id == worker_id,
                   EvalRun.status.in_((RUNNING, CANCELING)))
            .values(heartbeat_at=utcnow(),
                    generation_seconds=EvalRun.generation_seconds + generation_seconds,
                    grading_seconds=EvalRun.grading_seconds + grading_seconds)
            .execution_options(synchronize_session=False))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            raise RunLost(run_id)
        status = session.scalar(select(EvalRun.status).where(EvalRun.id == run_id))
    return status == CANCELING


def done_items(session: Session, run_id: str) -> set[int]:
    return set(session.scalars(select(EvalOutputItem.datasource_item_id)
                               .where(EvalOutputItem.run_id == run_id)))


def add_items(maker: sessionmaker[Session], run: EvalRun,
              graded: list[tuple[int, dict[str, Any], str, list[dict[str, Any]],
                                 dict[str, Any]]]) -> None:
    """Record graded items (n, item, status, results, sample) in one commit; an item that is
    there already (written by the worker this run was taken from) is kept as it was."""
    rows = [EvalOutputItem(run_id=run.id, eval_id=run.eval_id, datasource_item_id=n,
                           datasource_item=item, status=status, results=results, sample=sample)
            for n, item, status, results, sample in graded]
    try:
        with unit_of_work(maker) as session:
            session.add_all(rows)
    except IntegrityError:
        for row in rows:  # one at a time: keep the others
            try:
                with unit_of_work(maker) as session:
                    session.add(EvalOutputItem(**{c: getattr(row, c) for c in (
                        "run_id", "eval_id", "datasource_item_id", "datasource_item",
                        "status", "results", "sample")}))
            except IntegrityError:
                pass


def finish(maker: sessionmaker[Session], run_id: str, worker_id: str, status: str,
           error: tuple[str, str] | None = None) -> None:
    """End the run (completed, failed, canceled) with its counts summed from its items."""
    with unit_of_work(maker) as session:
        summary = summarize(item_rows(session, run_id))
        session.execute(
            update(EvalRun)
            .where(EvalRun.id == run_id, EvalRun.worker_id == worker_id,
                   EvalRun.status.in_((RUNNING, CANCELING)))
            .values(status=status, finished_at=utcnow(),
                    error_code=error[0] if error else None,
                    error_message=error[1] if error else None, **summary)
            .execution_options(synchronize_session=False))


def cancel(session: Session, run: EvalRun) -> EvalRun:
    """Ask a run to stop (idempotent): a queued run ends now, a running one at its worker's
    next heartbeat."""
    if run.status == QUEUED:
        run.status, run.finished_at = CANCELED, utcnow()
        run.cancel_requested_at = run.finished_at
        run_summary = summarize(item_rows(session, run.id))
        for k, v in run_summary.items():
            setattr(run, k, v)
    elif run.status == RUNNING:
        run.status, run.cancel_requested_at = CANCELING, utcnow()
    session.flush()
    return run


def item_rows(session: Session, run_id: str) -> list[tuple[str, list[dict[str, Any]],
                                                             dict[str, Any]]]:
    return [tuple(r) for r in session.execute(  # type: ignore[misc]
        select(EvalOutputItem.status, EvalOutputItem.results, EvalOutputItem.sample)
        .where(EvalOutputItem.run_id == run_id))]


def summarize(items: list[tuple[str, list[dict[str, Any]], dict[str, Any]]]) -> dict[str, Any]:
    """result_counts, per_testing_criteria_results and per_model_usage of a run's items."""
    counts = Counter(status for status, _, _ in items)
    per: dict[str, Counter[str]] = {}
    usage: dict[str, Counter[str]] = {}
    for _, results, sample in items:
        for r in results:
            c = per.setdefault(r["name"], Counter())
            c["errored" if r.get("error") else "passed" if r["passed"] else "failed"] += 1
        model = sample.get("model")
        if model:
            u = usage.setdefault(model, Counter())
            u["invocation_count"] += 1
            for key, value in (sample.get("usage") or {}).items():
                u[key] += int(value)
    return {
        "result_counts": {"total": len(items), "passed": counts["pass"],
                          "failed": counts["fail"], "errored": counts["error"]},
        "per_testing_criteria_results": [
            {"testing_criteria": name, "passed": c["passed"], "failed": c["failed"],
             "errored": c["errored"]} for name, c in per.items()],
        "per_model_usage": [
            {"model_name": model, "invocation_count": u["invocation_count"],
             "prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
             "total_tokens": u["total_tokens"], "cached_tokens": u["cached_tokens"]}
            for model, u in usage.items()],
    }


def stale_runs(session: Session, stale_seconds: float) -> list[str]:
    """Running runs whose worker stopped heart-beating: the reconciler sends them again."""
    cutoff = utcnow() - timedelta(seconds=stale_seconds)
    return list(session.scalars(select(EvalRun.id).where(
        EvalRun.status.in_((RUNNING, QUEUED)),
        or_(EvalRun.heartbeat_at < cutoff, EvalRun.heartbeat_at.is_(None)),
        EvalRun.created_at < cutoff)))
