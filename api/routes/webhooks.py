"""/v1/webhooks: endpoints that receive signed job events, and their deliveries."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from sqlalchemy import select

from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.openai.schemas import WebhookEvent as OpenAIWebhookEvent
from api.schemas import (
    DeliveryObject,
    Page,
    WebhookCreate,
    WebhookDeleted,
    WebhookObject,
    WebhookPayload,
)
from api.services import webhooks
from api.services.pagination import could_be_id
from core.db.models import WebhookEndpoint
from core.infra.errors import NotFound
from core.webhooks import outbox

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=error_responses(401))

MAX_BIGINT = 2**63 - 1


def get_endpoint(webhook_id: Annotated[str, Path()], session: SessionDep,
                 tenant: CurrentTenant) -> WebhookEndpoint:
    endpoint = None
    if could_be_id(webhook_id):
        endpoint = session.scalar(select(WebhookEndpoint).where(
            WebhookEndpoint.id == webhook_id, WebhookEndpoint.tenant_id == tenant.id))
    if endpoint is None:
        raise NotFound(f"no webhook {webhook_id!r}", param="webhook_id")
    return endpoint


EndpointDep = Annotated[WebhookEndpoint, Depends(get_endpoint)]


@router.post("", status_code=201, response_model=WebhookObject,
             responses=error_responses(400, 409, 422))
def create_webhook(body: WebhookCreate, session: SessionDep, tenant: CurrentTenant,
                   settings: SettingsDep) -> WebhookObject:
    """Register an endpoint. The answer holds the signing secret; it is not shown again."""
    return webhooks.create(session, tenant, body, settings)


@router.get("", response_model=Page[WebhookObject], responses=error_responses(422))
def list_webhooks(
    session: SessionDep,
    tenant: CurrentTenant,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="A webhook id: list older ones.")] = None,
) -> Page[WebhookObject]:
    """The tenant's endpoints, newest first."""
    return webhooks.list_endpoints(session, tenant, limit, after)


@router.get("/{webhook_id}", response_model=WebhookObject, responses=error_responses(404))
def get_webhook(endpoint: EndpointDep) -> WebhookObject:
    """One endpoint (without its secret)."""
    return webhooks.webhook_object(endpoint)


@router.delete("/{webhook_id}", response_model=WebhookDeleted, responses=error_responses(404))
def delete_webhook(endpoint: EndpointDep, session: SessionDep) -> WebhookDeleted:
    """Delete an endpoint; its pending deliveries are dropped."""
    webhooks.delete(session, endpoint)
    return WebhookDeleted(id=endpoint.id)


@router.get("/{webhook_id}/deliveries", response_model=Page[DeliveryObject],
            responses=error_responses(404, 422))
def list_deliveries(
    endpoint: EndpointDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[int | None, Query(ge=0, le=MAX_BIGINT,
                                       description="A delivery id: list older ones.")] = None,
) -> Page[DeliveryObject]:
    """Deliveries to this endpoint, newest first: attempts, last status code and error."""
    return webhooks.list_deliveries(session, endpoint, limit, after)


@router.post("/{webhook_id}/test", status_code=202, response_model=DeliveryObject,
             responses=error_responses(404))
def test_webhook(endpoint: EndpointDep, session: SessionDep) -> DeliveryObject:
    """Queue a `webhook.test` event to this endpoint; the sender delivers it like any other."""
    return webhooks.send_test(session, endpoint)


# What the service POSTs to registered endpoints: documented as OpenAPI webhooks.
events = APIRouter()


def _document_event(event_type: str) -> None:
    def receive(body: WebhookPayload) -> None:
        """Answer 2xx within the timeout; anything else is retried with backoff."""

    def receive_openai(body: OpenAIWebhookEvent) -> None:
        """OpenAI's event body; answer 2xx within the timeout, else it is retried."""

    openai = event_type in outbox.OPENAI_STATUS_EVENTS.values()
    events.add_api_route(event_type, receive_openai if openai else receive, methods=["POST"],
                         name=event_type,
                         summary=f"{event_type} (sent to your endpoint)")


for _event_type in (*outbox.EVENT_TYPES, outbox.TEST_EVENT):
    _document_event(_event_type)
