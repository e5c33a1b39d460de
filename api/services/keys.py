"""API keys: create, check, revoke. Only a SHA-256 of a key is stored; the key is shown once.

Used by the API (authentication, the bootstrap key) and by the CLI (``ftune keys ...``).
None of these commit: the caller's unit of work does.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db.models import ApiKey, Tenant, utcnow
from core.infra.errors import NotFound, Unauthorized

KEY_PREFIX = "ft_"
ROLES = ("tenant", "admin")
PUBLIC_PREFIX_LEN = 10
LAST_USED_RESOLUTION = timedelta(minutes=1)


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def public_prefix(key: str) -> str:
    return key[:PUBLIC_PREFIX_LEN]


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is not None:
        return tenant
    try:
        with session.begin_nested():
            tenant = Tenant(name=name)
            session.add(tenant)
    except IntegrityError:  # created concurrently
        tenant = session.scalars(select(Tenant).where(Tenant.name == name)).one()
    return tenant


def _add_key(
    session: Session, tenant: Tenant, key: str, key_name: str, role: str = "tenant"
) -> ApiKey:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    row = ApiKey(
        tenant_id=tenant.id,
        name=key_name,
        prefix=public_prefix(key),
        key_hash=hash_key(key),
        role=role,
    )
    session.add(row)
    return row


def create_api_key(
    session: Session, tenant_name: str, key_name: str = "", *, role: str = "tenant"
) -> str:
    """Create a key for ``tenant_name`` (the tenant too if missing); return the key, once.
    ``role`` admin: the key also sees and drains the fleet (GET /v1/workers)."""
    if not tenant_name.strip():
        raise ValueError("tenant name must not be empty")
    tenant = get_or_create_tenant(session, tenant_name)
    key = generate_key()
    _add_key(session, tenant, key, key_name, role)
    return key


def ensure_bootstrap_key(session: Session, key: str, tenant_name: str = "default") -> Tenant:
    """Make ``key`` (settings.bootstrap_api_key) a valid key of ``tenant_name``; idempotent.
    It is the operator's own key (``ftune up`` prints it), so it is an admin key."""
    existing = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    if existing is not None:
        existing.role = "admin"  # made before roles existed (the migration made it a tenant key)
        return session.get_one(Tenant, existing.tenant_id)
    tenant = get_or_create_tenant(session, tenant_name)
    try:
        with session.begin_nested():
            _add_key(session, tenant, key, "bootstrap", "admin")
    except IntegrityError:  # another process registered it first
        pass
    return tenant


@dataclass(frozen=True)
class KeyInfo:
    id: str
    tenant: str
    name: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    role: str = "tenant"


def list_api_keys(session: Session, tenant_name: str | None = None) -> list[KeyInfo]:
    """Every key (never the key itself), optionally of one tenant, oldest first."""
    q = select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
    if tenant_name is not None:
        q = q.where(Tenant.name == tenant_name)
    rows = session.execute(q.order_by(ApiKey.created_at, ApiKey.id)).all()
    return [
        KeyInfo(k.id, t, k.name, k.prefix, k.created_at, k.last_used_at, k.revoked_at, k.role)
        for k, t in rows
    ]


def revoke_api_key(session: Session, key_id_or_prefix: str) -> None:
    """Revoke by key id (``key-...``) or public prefix (``ft_xxxxxxx``); idempotent."""
    rows = session.scalars(
        select(ApiKey).where(or_(ApiKey.id == key_id_or_prefix, ApiKey.prefix == key_id_or_prefix))
    ).all()
    if not rows:
        raise NotFound(f"no API key {key_id_or_prefix!r}")
    if len(rows) > 1:
        raise NotFound(f"prefix {key_id_or_prefix!r} matches several keys; use the key id")
    if rows[0].revoked_at is None:
        rows[0].revoked_at = utcnow()


@dataclass
class KeyCache:
    """Keys verified in the last ``ttl`` seconds -> their tenant (by the key's hash, never the
    key), so a client polling with a key costs no database read per request. Bounds: a
    revoked key keeps working here for at most ``ttl`` seconds; only keys that verified are
    kept (a refused key is read again every time); at most ``max_entries`` keys.

    An entry past half its ``ttl`` is due for a refresh (``lookup``): the caller verifies the
    key again in the background while requests keep using the entry, so a key in steady
    use never expires under its requests. Before, every ``ttl`` seconds all requests with
    the key waited together for its verification (a thread, a query, and once a minute the
    last-use write, which on SQLite queues behind the worker's writes): bursts of requests
    0.2-0.9 s late every 10 s were seen in `ftune up`'s API log under load
    (bench/api_latency.py --ftune-up)."""

    ttl: float
    max_entries: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, tuple[Tenant, float]] = field(default_factory=dict)

    def get(self, key_hash: str) -> Tenant | None:
        return self.lookup(key_hash)[0]

    def lookup(self, key_hash: str) -> tuple[Tenant | None, bool]:
        """(the tenant if the entry is still valid, whether it is due for a refresh)."""
        entry = self._entries.get(key_hash)
        if entry is None:
            return None, False
        tenant, expires = entry
        now = self.clock()
        if now >= expires:
            self._entries.pop(key_hash, None)
            return None, False
        return tenant, now >= expires - self.ttl / 2

    def put(self, key_hash: str, tenant: Tenant) -> None:
        if self.ttl <= 0:
            return
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key_hash] = (tenant, self.clock() + self.ttl)

    def drop(self, key_hash: str) -> None:
        self._entries.pop(key_hash, None)


def key_role(session: Session, key: str) -> str | None:
    """The role of a valid, unrevoked key, or None."""
    row = session.execute(
        select(ApiKey.role).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    ).first()
    return None if row is None else str(row[0])


def authenticate(session: Session, key: str) -> tuple[Tenant, str | None]:
    """The tenant owning a valid, unrevoked key, or Unauthorized; with the key's id when its
    last use is due to be recorded (``record_use``; at most once a minute). Only reads:
    the write is the caller's to make where no request waits for it (on SQLite a write
    queues behind every other writer's)."""
    row = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_hash == hash_key(key))
    ).first()
    if row is None:
        raise Unauthorized("invalid API key")
    api_key, tenant = row
    if api_key.revoked_at is not None:
        raise Unauthorized("this API key was revoked")
    due = api_key.last_used_at is None or utcnow() - api_key.last_used_at >= LAST_USED_RESOLUTION
    return tenant, api_key.id if due else None


def record_use(session: Session, key_id: str) -> None:
    """Record a key's use now, unless it was recorded in the last minute (the guard keeps
    concurrent recorders, in this process or others, to one write)."""
    now = utcnow()
    session.execute(
        update(ApiKey)
        .where(
            ApiKey.id == key_id,
            or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < now - LAST_USED_RESOLUTION),
        )
        .values(last_used_at=now)
    )
