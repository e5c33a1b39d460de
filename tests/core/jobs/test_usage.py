"""core/jobs/usage.py: totals per job, by day, cost; and the step count of core/data/counts.py."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from core.data.counts import optimizer_steps
from core.db.models import Job, JobAttempt, Tenant
from core.jobs.usage import (
    Totals,
    attempt_reported,
    by_day,
    close_attempt,
    cost,
    ended_totals_by_tenant,
    job_totals,
    open_attempt,
    recount_days,
    recount_totals_by_tenant,
    spec_processes,
    tenant_days,
)
from tests.utils.specs import parsed_spec

T0 = datetime(2026, 11, 20, 23, 0, tzinfo=UTC)


def attempt(job: str, n: int, start: datetime, seconds: float | None, processes: int = 1,
            tokens: int = 0, loss_tokens: int = 0) -> JobAttempt:
    end = start + timedelta(seconds=seconds) if seconds is not None else None
    return JobAttempt(job_id=job, attempt=n, started_at=start, ended_at=end,
                      processes=processes, tokens=tokens, loss_tokens=loss_tokens)


def test_job_totals_sum_attempts_and_weigh_seconds_by_processes() -> None:
    t = job_totals([attempt("j", 1, T0, 100, processes=2, tokens=10, loss_tokens=4),
                    attempt("j", 2, T0 + timedelta(hours=1), 50, processes=4, tokens=5)],
                   now=T0 + timedelta(days=1))
    assert (t.tokens, t.loss_tokens, t.attempts) == (15, 4, 2)
    assert t.wall_seconds == 150 and t.gpu_seconds == 2 * 100 + 4 * 50


def test_a_running_attempt_counts_up_to_now() -> None:
    t = job_totals([attempt("j", 1, T0, None, processes=2)], now=T0 + timedelta(seconds=30))
    assert (t.wall_seconds, t.gpu_seconds) == (30, 60)


def test_by_day_uses_the_utc_day_an_attempt_ended_and_fills_empty_days() -> None:
    rows = [
        attempt("a", 1, T0, 30 * 60, tokens=1),  # ends 23:30 on the 20th
        attempt("a", 2, T0, 2 * 3600, tokens=2),  # ends 01:00 on the 21st
        attempt("b", 1, T0 + timedelta(days=1), 60, processes=8, tokens=4),  # 21st
        attempt("c", 1, T0, None, tokens=100),  # still running: not in any day
        attempt("d", 1, T0 - timedelta(days=5), 60, tokens=1000),  # before the range
    ]
    days = by_day(rows, date(2026, 11, 20), date(2026, 11, 22))
    assert [d for d, _ in days] == [date(2026, 11, 20), date(2026, 11, 21), date(2026, 11, 22)]
    d20, d21, d22 = (t for _, t in days)
    assert (d20.tokens, d20.attempts, d20.jobs) == (1, 1, {"a"})
    assert (d21.tokens, d21.attempts, d21.jobs) == (6, 2, {"a", "b"})
    assert d21.gpu_seconds == 2 * 3600 + 8 * 60
    assert (d22.tokens, d22.attempts) == (0, 0)


def test_cost_is_gpu_hours_times_the_price_or_none() -> None:
    assert cost(7200, 2.5) == 5.0
    assert cost(7200, None) is None
    t = job_totals([attempt("j", 1, T0, 1800, processes=4)], now=T0)
    assert t.as_dict(3.0, "EUR")["cost"] == 6.0 and t.as_dict(3.0, "EUR")["currency"] == "EUR"
    assert t.as_dict(None, "EUR")["currency"] is None


def test_processes_of_a_spec() -> None:
    assert spec_processes({}) == 1
    assert spec_processes({"distributed": {"strategy": "none", "num_processes": 4}}) == 1
    assert spec_processes({"distributed": {"strategy": "ddp", "num_processes": 4}}) == 4


def _spec(**training: object) -> object:
    return parsed_spec(dataset={"file_id": "file-x"}, training=training,
                       distributed={"strategy": "ddp", "num_processes": 2})


@pytest.mark.parametrize(
    ("rows", "training", "expected"),
    [
        # 2 ranks x 25 rows -> 4 batches of 8 -> 2 steps of 2 micro-batches, x 3 epochs
        (50, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
              "num_train_epochs": 3}, (6, 2)),
        # 3 batches, accumulation 2: the last step takes the remaining micro-batch
        (48, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
              "num_train_epochs": 1.5}, (3, 2)),
        (48, {"per_device_train_batch_size": 8, "max_steps": 7}, (7, 3)),
    ],
)
def test_optimizer_steps_as_the_trainer_counts_them(
    rows: int, training: dict[str, object], expected: tuple[int, int]
) -> None:
    assert optimizer_steps(rows, _spec(**training)) == expected  # type: ignore[arg-type]


@pytest.fixture(params=["sqlite", "postgres"])
def db_session(request: pytest.FixtureRequest) -> Iterator[Session]:
    from sqlalchemy.orm import sessionmaker

    from core.db.session import make_engine

    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")
    engine = make_engine(url)
    try:
        with sessionmaker(bind=engine)() as s:
            yield s
    finally:
        engine.dispose()


def _tenant_job(s: Session) -> tuple[str, str]:
    tenant = Tenant(name=f"usage-{secrets.token_hex(4)}")
    s.add(tenant)
    s.flush()
    job = Job(tenant_id=tenant.id, spec={}, status="succeeded")
    s.add(job)
    s.flush()
    return tenant.id, job.id


def _run(s: Session, job_id: str, n: int, start: datetime, seconds: float | None,
         processes: int = 1, tokens: int = 0, loss_tokens: int = 0) -> None:
    """Attempt ``n`` as production records it: the claim opens it, the monitor reports its
    tokens, the move that ends it closes it (``seconds`` None: still running)."""
    open_attempt(s, job_id, attempt=n, worker_id="w", started_at=start, processes=processes)
    s.execute(update(JobAttempt).where(JobAttempt.job_id == job_id, JobAttempt.attempt == n)
              .values(tokens=tokens, loss_tokens=loss_tokens))
    if seconds is not None:
        close_attempt(s, job_id, ended_at=start + timedelta(seconds=seconds))


def _as_tuple(t: Totals) -> tuple[int, int, int, int, float, float]:
    return (t.attempts, t.job_count, t.tokens, t.loss_tokens, round(t.wall_seconds, 3),
            round(t.gpu_seconds, 3))


def test_kept_day_sums_equal_a_recount_of_the_attempts(db_session: Session) -> None:
    s = db_session
    tenant, a = _tenant_job(s)
    b = s.scalar(insert(Job).values(id=f"job-{secrets.token_hex(6)}", tenant_id=tenant, spec={},
                                    status="succeeded").returning(Job.id))
    assert b is not None
    other_tenant, c = _tenant_job(s)
    _run(s, a, 1, T0, 30 * 60, processes=2, tokens=10, loss_tokens=4)  # ends 23:30 on the 20th
    _run(s, a, 2, T0 + timedelta(hours=1), 90.5, processes=4, tokens=5)  # 00:01:30, the 21st
    _run(s, a, 3, T0 + timedelta(hours=2), 60.25, tokens=7)  # the 21st again: one job that day
    _run(s, b, 1, T0 + timedelta(days=1), 3600, processes=8, tokens=4, loss_tokens=1)  # 22nd
    _run(s, b, 2, T0 + timedelta(days=2), None, tokens=10**6)  # running: in no day
    _run(s, c, 1, T0, 45, tokens=99)  # another tenant's
    s.commit()
    first, last = date(2026, 11, 19), date(2026, 11, 23)
    kept = [(d, _as_tuple(t)) for d, t in tenant_days(s, tenant, first, last)]
    assert kept == [(d, _as_tuple(t)) for d, t in recount_days(s, tenant, first, last)]
    assert [t[:3] for _, t in kept] == [(0, 0, 0), (1, 1, 10), (2, 1, 12), (1, 1, 4), (0, 0, 0)]
    assert ended_totals_by_tenant(s)[other_tenant].tokens == 99


def test_kept_totals_equal_a_recount_of_the_day_sums(db_session: Session) -> None:
    s = db_session
    tenant, a = _tenant_job(s)
    _run(s, a, 1, T0, 30 * 60, processes=2, tokens=10, loss_tokens=4)
    _run(s, a, 2, T0 + timedelta(days=3), 90.5, processes=4, tokens=5)
    _run(s, a, 3, T0 + timedelta(days=40), None, tokens=7)  # running: in no total yet
    late = {"tokens": 25, "loss_tokens": 5, "processes": 2}
    attempt_reported(s, a, 1, late)  # the first attempt's last events, ingested late
    s.execute(update(JobAttempt).where(JobAttempt.job_id == a, JobAttempt.attempt == 1)
              .values(**late))
    s.commit()
    kept, recount = ended_totals_by_tenant(s)[tenant], recount_totals_by_tenant(s)[tenant]
    assert _as_tuple(kept)[:1] + _as_tuple(kept)[2:] == (2, 30, 5, 1890.5, 3962.0)
    assert kept == recount


def test_tokens_reported_after_the_attempt_ended_count_in_its_day(db_session: Session) -> None:
    s = db_session
    tenant, job = _tenant_job(s)
    _run(s, job, 1, T0 + timedelta(hours=2), 100, processes=1, tokens=10)
    late = {"tokens": 25, "loss_tokens": 5, "processes": 2}  # the last events, ingested late
    attempt_reported(s, job, 1, late)
    s.execute(update(JobAttempt).where(JobAttempt.job_id == job).values(**late))
    s.commit()
    day = date(2026, 11, 21)
    (_, kept), = tenant_days(s, tenant, day, day)
    (_, recount), = recount_days(s, tenant, day, day)
    assert _as_tuple(kept) == _as_tuple(recount) == (1, 1, 25, 5, 100.0, 200.0)
