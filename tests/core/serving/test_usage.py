"""Inference usage written in batches (core/serving/usage.py UsageBuffer): what an API
process summed in memory reaches the day's row whole, beside another process's, on SQLite
and PostgreSQL; a write that fails keeps its counts for the next one."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import Tenant
from core.db.session import make_engine
from core.serving.tables import InferenceUsage
from core.serving.usage import UsageBuffer
from tests.utils.api import migrated_sessionmaker


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def maker(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[sessionmaker[Session]]:
    with migrated_sessionmaker(request.param, tmp_path_factory) as made:
        yield made


def new_tenant(maker: sessionmaker[Session]) -> str:
    with maker() as session:
        tenant = Tenant(name=f"usage-{secrets.token_hex(6)}")
        session.add(tenant)
        session.commit()
        return tenant.id


def rows(maker: sessionmaker[Session], tenant_id: str) -> list[tuple[str, int, int, int]]:
    with maker() as session:
        return [(u.model, u.requests, u.prompt_tokens, u.completion_tokens)
                for u in session.scalars(select(InferenceUsage)
                                         .where(InferenceUsage.tenant_id == tenant_id)
                                         .order_by(InferenceUsage.model))]


def test_a_flush_writes_the_sums_of_every_answer_since_the_last(
        maker: sessionmaker[Session]) -> None:
    tenant, buffer = new_tenant(maker), UsageBuffer()
    for _ in range(5):
        buffer.add(tenant, "tiny-llama", 10, 4)
    buffer.add(tenant, "ft:tiny-llama:acme:abc", 3, 2)
    assert rows(maker, tenant) == []  # nothing written before the flush
    with maker() as session:
        buffer.flush(session)
    assert not buffer
    assert rows(maker, tenant) == [("ft:tiny-llama:acme:abc", 1, 3, 2), ("tiny-llama", 5, 50, 20)]


def test_two_processes_add_to_the_same_days_row(maker: sessionmaker[Session]) -> None:
    tenant, here, there = new_tenant(maker), UsageBuffer(), UsageBuffer()
    here.add(tenant, "tiny-llama", 10, 4)
    there.add(tenant, "tiny-llama", 7, 1)
    there.add(tenant, "tiny-llama", 7, 1)
    for buffer in (here, there, here):  # the second flush of `here` has nothing to add
        with maker() as session:
            buffer.flush(session)
    assert rows(maker, tenant) == [("tiny-llama", 3, 24, 6)]


def test_a_failed_write_keeps_the_counts_for_the_next_flush(
        maker: sessionmaker[Session], tmp_path_factory: pytest.TempPathFactory) -> None:
    tenant, buffer = new_tenant(maker), UsageBuffer()
    buffer.add(tenant, "tiny-llama", 10, 4)
    buffer.add(tenant, "other", 1, 1)
    # A database without ftune's tables: every write fails.
    broken = make_engine(f"sqlite:///{tmp_path_factory.mktemp('empty')}/empty.db")
    try:
        with sessionmaker(bind=broken)() as session:
            buffer.flush(session)
    finally:
        broken.dispose()
    assert buffer and rows(maker, tenant) == []
    with maker() as session:
        buffer.flush(session)
    assert rows(maker, tenant) == [("other", 1, 1, 1), ("tiny-llama", 1, 10, 4)]
