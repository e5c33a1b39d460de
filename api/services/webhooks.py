"""Webhook use-cases: register (URL checked, secret shown once), read, delete, the
deliveries, and a test event on demand. Sending is the worker's (worker/upkeep/webhook_sender.py)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.schemas import DeliveryObject, Page, WebhookCreate, WebhookObject
from api.services.pagination import page_after
from core.db.models import (
    DeliveryStatus,
    Tenant,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    new_id,
    utcnow,
)
from core.infra import netguard
from core.infra.errors import Conflict, InvalidRequest
from core.infra.settings import Settings
from core.webhooks import outbox


def webhook_object(e: WebhookEndpoint, *, with_secret: bool = False) -> WebhookObject:
    return WebhookObject(id=e.id, url=e.url, event_types=list(e.event_types or []),
                         description=e.description or "", created_at=e.created_at,
                         secret=e.secret if with_secret else None)


def create(session: Session, tenant: Tenant, body: WebhookCreate,
           settings: Settings) -> WebhookObject:
    asked = outbox.DEFAULT_EVENT_TYPES if body.event_types is None else body.event_types
    types = list(dict.fromkeys(asked))
    unknown = [t for t in types if t not in outbox.EVENT_TYPES]
    if unknown or not types:
        raise InvalidRequest(
            f"unknown event type(s) {unknown}: choose from {list(outbox.EVENT_TYPES)}"
            if unknown else "name at least one event type", param="event_types")
    if "\x00" in body.description:
        raise InvalidRequest("must not contain NUL characters", param="description")
    try:
        netguard.check(body.url, settings)
    except netguard.UrlRefused as e:
        raise InvalidRequest(f"url: {e}", param="url") from None
    count = session.scalar(select(func.count(WebhookEndpoint.id))
                           .where(WebhookEndpoint.tenant_id == tenant.id)) or 0
    if count >= settings.webhook_max_endpoints_per_tenant:
        raise Conflict(f"this tenant already has {count} webhook endpoints, the most this "
                       "server allows; delete one first")
    endpoint = WebhookEndpoint(id=new_id("wh"), tenant_id=tenant.id, url=body.url,
                               description=body.description, event_types=types,
                               secret=outbox.new_secret(), created_at=utcnow())
    session.add(endpoint)
    session.flush()
    return webhook_object(endpoint, with_secret=True)


def list_endpoints(session: Session, tenant: Tenant, limit: int,
                   after: str | None) -> Page[WebhookObject]:
    q = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant.id)
    rows, has_more = page_after(session, q, WebhookEndpoint, tenant.id, limit, after)
    return Page(data=[webhook_object(e) for e in rows], has_more=has_more,
                next_cursor=rows[-1].id if has_more else None)


def delete(session: Session, endpoint: WebhookEndpoint) -> None:
    """The endpoint and its pending deliveries go: nothing more is sent to it."""
    session.delete(endpoint)
    session.flush()


def delivery_object(d: WebhookDelivery, event_type: str) -> DeliveryObject:
    return DeliveryObject(
        id=d.id, event_id=d.event_id, event_type=event_type, status=d.status,
        attempts=d.attempts, last_status_code=d.last_status_code, last_error=d.last_error,
        next_attempt_at=d.next_attempt_at if d.status == DeliveryStatus.pending else None,
        delivered_at=d.delivered_at, created_at=d.created_at,
    )


def list_deliveries(session: Session, endpoint: WebhookEndpoint, limit: int,
                    after: int | None) -> Page[DeliveryObject]:
    """Newest first; ``after`` is a delivery id."""
    q = (select(WebhookDelivery, WebhookEvent.type)
         .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
         .where(WebhookDelivery.endpoint_id == endpoint.id))
    if after is not None:
        q = q.where(WebhookDelivery.id < after)
    rows = session.execute(q.order_by(WebhookDelivery.id.desc()).limit(limit + 1)).all()
    has_more = len(rows) > limit
    rows = rows[:limit]
    return Page(data=[delivery_object(d, t) for d, t in rows], has_more=has_more,
                next_cursor=str(rows[-1][0].id) if has_more else None)


def send_test(session: Session, endpoint: WebhookEndpoint) -> DeliveryObject:
    """A ``webhook.test`` event to this endpoint only, through the outbox like any other."""
    event = outbox.record(session, endpoint.tenant_id, outbox.TEST_EVENT,
                          {"object": "webhook", "id": endpoint.id}, [endpoint.id])
    delivery = session.scalars(select(WebhookDelivery)
                               .where(WebhookDelivery.event_id == event.id)).one()
    return delivery_object(delivery, event.type)
