"""core/jobs/usage.py: totals per job, by day, cost; and the step count of core/jobs/estimate.py."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest

from core.db.models import JobAttempt
from core.jobs.estimate import optimizer_steps
from core.jobs.usage import by_day, cost, job_totals, spec_processes
from core.spec import parse_job_spec

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
    return parse_job_spec({
        "model": {"name_or_path": "org/m"},
        "dataset": {"file_id": "file-x"},
        "training": training,
        "distributed": {"strategy": "ddp", "num_processes": 2},
    })


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


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_database_sums_match_the_python_sums(backend: str, request: pytest.FixtureRequest) -> None:
    """The SQL behind the Prometheus counters and GET /v1/usage, on both databases."""
    import secrets

    from sqlalchemy.orm import sessionmaker

    from core.db.models import Job, Tenant
    from core.db.session import make_engine
    from core.jobs.usage import ended_totals_by_tenant, tenant_attempts

    url = request.getfixturevalue("pg_url" if backend == "postgres" else "sqlite_url")
    engine = make_engine(url)
    try:
        with sessionmaker(bind=engine)() as s:
            tenants = [Tenant(name=f"usage-{secrets.token_hex(4)}") for _ in range(2)]
            s.add_all(tenants)
            s.flush()
            rows = {t.id: [] for t in tenants}
            for i, t in enumerate(tenants):
                job = Job(tenant_id=t.id, spec={}, status="succeeded")
                s.add(job)
                s.flush()
                for n in (1, 2):
                    a = attempt(job.id, n, T0 + timedelta(hours=n), 90.5 * n + i,
                                processes=n + i, tokens=100 * n, loss_tokens=10 * n)
                    rows[t.id].append(a)
                s.add(attempt(job.id, 3, T0, None, tokens=10**6))  # running: not counted
                s.add_all(rows[t.id])
            s.commit()
            totals = ended_totals_by_tenant(s)
            for t in tenants:
                want = job_totals(rows[t.id], now=T0)
                got = totals[t.id]
                assert (got.tokens, got.loss_tokens, got.attempts) == (300, 30, 2)
                assert got.wall_seconds == pytest.approx(want.wall_seconds, abs=1e-3)
                assert got.gpu_seconds == pytest.approx(want.gpu_seconds, abs=1e-3)
            t0 = tenants[0].id
            found = tenant_attempts(s, t0, date(2026, 11, 21), date(2026, 11, 21))
            assert sorted(a.attempt for a in found) == [1, 2]  # both end on the 21st (UTC)
            assert tenant_attempts(s, t0, date(2026, 11, 20), date(2026, 11, 20)) == []
    finally:
        engine.dispose()
