"""The reconciler sends again the eval runs no worker keeps alive: a running run whose
worker stopped heart-beating (the next worker resumes it) and a queued one whose message was
lost; a run a worker is heart-beating is left alone."""

from __future__ import annotations

import pytest

from core.db.models import Eval, EvalRun
from core.db.session import session_scope
from tests.utils.worker import WorkerEnv, ago, make_tenant
from worker.upkeep.reconciler import reconcile


@pytest.fixture
def resent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import core.evals.dispatch

    calls: list[str] = []
    monkeypatch.setattr(core.evals.dispatch, "enqueue_run", calls.append)
    return calls


def _run(eval_id: str, tenant_id: str, status: str, heartbeat_age: float | None) -> str:
    with session_scope() as s:
        run = EvalRun(eval_id=eval_id, tenant_id=tenant_id, name="", model="", status=status,
                      data_source={"type": "jsonl"}, items_total=1, attempt=0,
                      generation_seconds=0.0, grading_seconds=0.0, created_at=ago(3600),
                      heartbeat_at=None if heartbeat_age is None else ago(heartbeat_age))
        s.add(run)
        s.flush()
        return run.id


def test_runs_nobody_keeps_alive_are_sent_again(wenv: WorkerEnv, resent: list[str]) -> None:
    tenant = make_tenant()
    with session_scope() as s:
        ev = Eval(tenant_id=tenant, name="", data_source_config={}, testing_criteria=[])
        s.add(ev)
        s.flush()
        eval_id = ev.id
    stale = wenv.settings.eval_stale_seconds + 5
    dead = _run(eval_id, tenant, "in_progress", stale)
    lost = _run(eval_id, tenant, "queued", None)
    _run(eval_id, tenant, "in_progress", 1)  # alive
    _run(eval_id, tenant, "completed", stale)  # finished
    assert reconcile()["eval_runs_resent"] == 2
    assert sorted(resent) == sorted([dead, lost])
