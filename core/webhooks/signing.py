"""Standard Webhooks signatures (https://www.standardwebhooks.com): the headers of one
attempt, made with the ``standardwebhooks`` package so receivers verify with any of the
spec's libraries."""

from __future__ import annotations

from datetime import datetime

from standardwebhooks import Webhook


def headers(secret: str, msg_id: str, at: datetime, body: str) -> dict[str, str]:
    """``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` (``v1,<base64 HMAC-
    SHA256 of "{id}.{timestamp}.{body}">``). The id is the event's, the same on every retry;
    the timestamp is the attempt's."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, at, body),
    }
