"""Newest-first cursor pagination over (created_at, id)."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_, select
from sqlalchemy.orm import Session

from core.infra.errors import InvalidRequest

M = TypeVar("M")


def could_be_id(value: str) -> bool:
    """Ids are short and printable; anything else (a NUL byte, which PostgreSQL refuses in
    a query) names no object, so it is not looked up."""
    return len(value) <= 64 and value.isprintable()


def page_after(
    session: Session,
    query: Select[M],
    model: Any,
    tenant_id: str,
    limit: int,
    after: str | None,
    keys: tuple[Any, Any] | None = None,
) -> tuple[list[M], bool]:
    """Up to ``limit`` rows of ``query`` older than the tenant's object ``after``.
    ``keys``: the (created_at, id) columns to order and compare on, when an index of another
    table that holds copies of them gives the order (default: the model's own)."""
    created, ident = keys or (model.created_at, model.id)
    if after is not None:
        anchor = None
        if could_be_id(after):
            anchor = session.execute(
                select(model.created_at, model.id).where(
                    model.id == after, model.tenant_id == tenant_id
                )
            ).first()
        if anchor is None:
            raise InvalidRequest(f"no object {after!r} to continue after", param="after")
        created_at, anchor_id = anchor
        query = query.where(
            # The first term is implied by the second; it is the one a planner can read an
            # index range from (SQLite scanned every newer row of the tenant without it).
            created <= created_at,
            or_(
                created < created_at,
                and_(created == created_at, ident < anchor_id),
            ),
        )
    rows = list(
        session.scalars(query.order_by(created.desc(), ident.desc()).limit(limit + 1))
    )
    return rows[:limit], len(rows) > limit
