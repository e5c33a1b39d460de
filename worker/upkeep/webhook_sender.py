"""The webhook sender: claims due deliveries from the outbox, POSTs them signed, and records
what happened. Runs as a thread in every worker (``webhook_sender_in_worker``, the default,
so ``ftune up`` delivers) or as a process of its own (``ftune webhooks``). Any number may run
at once: a claim is one UPDATE that leases rows (PostgreSQL skips rows another sender is
claiming; SQLite has one writer at a time), and an outcome is written only by the lease's
holder.

At least once: a sender that dies between the POST and the record leaves a lease that runs
out, and the delivery is sent again under the same ``webhook-id``. A failed attempt waits
``webhook_retry_base_seconds`` x 2^(attempts-1) (capped) before the next; once the next
would fall beyond ``webhook_retry_window_seconds`` after the event, the delivery is failed."""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import (
    DeliveryStatus,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    utcnow,
)
from core.db.session import execute_rowcount, unit_of_work
from core.infra import netguard
from core.infra.settings import Settings
from core.webhooks import signing

log = logging.getLogger(__name__)

BATCH = 16  # claimed at once, and sent in parallel (so a batch takes about one timeout)
MAX_ERROR_CHARS = 500
USER_AGENT = "ftune-webhooks/1"
PRUNE_EVERY_SECONDS = 600.0


@dataclass(frozen=True)
class Claimed:
    delivery_id: int
    lease: str
    attempts: int  # including the one about to be made
    event_id: str
    event_created_at: datetime
    payload: dict[str, Any]
    url: str
    secret: str


@dataclass(frozen=True)
class Outcome:
    status_code: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def retry_delay(attempts: int, settings: Settings) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt."""
    base = settings.webhook_retry_base_seconds * 2 ** min(attempts - 1, 62)
    return float(min(base, settings.webhook_retry_max_interval_seconds))


class Sender:
    def __init__(self, maker: sessionmaker[Session], settings: Settings, *,
                 name: str | None = None, verify: ssl.SSLContext | bool = True) -> None:
        """``verify``: how TLS certificates are checked (default: the system's CAs)."""
        self.maker = maker
        self.settings = settings
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.client = httpx.Client(
            follow_redirects=False,  # a redirect is an answer, not a new address to call
            trust_env=False,  # no proxy from the environment: the checked address is called
            timeout=httpx.Timeout(settings.webhook_timeout_seconds),
            # No reuse: a pooled TLS connection is keyed by address, not by the host it was
            # verified for.
            limits=httpx.Limits(max_keepalive_connections=0),
            headers={"user-agent": USER_AGENT},
            verify=verify,
        )

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ claim

    def claim(self, now: datetime | None = None, limit: int = BATCH) -> list[Claimed]:
        """Lease up to ``limit`` due deliveries: pending, due, and not leased by a sender
        whose lease still runs. One UPDATE, so two senders never hold the same row."""
        now = now or utcnow()
        lease = f"{self.name[:40]}:{secrets.token_hex(6)}"
        free = or_(WebhookDelivery.lease_until.is_(None), WebhookDelivery.lease_until < now)
        due = [WebhookDelivery.status == DeliveryStatus.pending,
               WebhookDelivery.next_attempt_at <= now, free]
        pick = (select(WebhookDelivery.id).where(*due)
                .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id).limit(limit)
                .with_for_update(skip_locked=True))  # PostgreSQL; SQLite renders nothing
        with unit_of_work(self.maker) as s:
            n = execute_rowcount(s, update(WebhookDelivery)
                                 .where(WebhookDelivery.id.in_(pick.scalar_subquery()), *due)
                                 .values(lease_owner=lease,
                                         lease_until=now + timedelta(
                                             seconds=self.settings.webhook_lease_seconds),
                                         attempts=WebhookDelivery.attempts + 1)
                                 .execution_options(synchronize_session=False))
            if n == 0:
                return []
            rows = s.execute(
                select(WebhookDelivery.id, WebhookDelivery.attempts, WebhookEvent.id,
                       WebhookEvent.created_at, WebhookEvent.payload, WebhookEndpoint.url,
                       WebhookEndpoint.secret)
                .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
                .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
                .where(WebhookDelivery.lease_owner == lease)
                .order_by(WebhookDelivery.id)
            ).all()
        return [Claimed(r[0], lease, r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows]

    # ------------------------------------------------------------------ send

    def attempt(self, c: Claimed) -> Outcome:
        """One signed POST to the checked address. Never raises."""
        try:
            target = netguard.check(c.url, self.settings)
        except netguard.UrlRefused as e:
            return Outcome(None, f"refused: {e}")
        body = json.dumps(c.payload, separators=(",", ":"))
        headers = {
            **signing.headers(c.secret, c.event_id, utcnow(), body),
            "content-type": "application/json",
            "host": target.host_header,
        }
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        deadline = time.monotonic() + self.settings.webhook_timeout_seconds
        try:
            with self.client.stream("POST", target.connect_url, content=body.encode(),
                                    headers=headers, extensions=extensions) as r:
                read = 0
                for chunk in r.iter_raw():
                    read += len(chunk)
                    if read >= self.settings.webhook_max_response_bytes:
                        break  # the answer is the status; the body is not needed
                    if time.monotonic() > deadline:
                        return Outcome(r.status_code, "timed out reading the response")
                if 200 <= r.status_code < 300:
                    return Outcome(r.status_code, None)
                where = r.headers.get("location")
                why = f"HTTP {r.status_code}" + (f" (redirect to {where} not followed)"
                                                 if 300 <= r.status_code < 400 and where else "")
                return Outcome(r.status_code, why[:MAX_ERROR_CHARS])
        except httpx.TimeoutException as e:
            return Outcome(None, f"timed out ({type(e).__name__})")
        except httpx.HTTPError as e:
            return Outcome(None, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS])
        except Exception as e:  # a bug here must not lose the batch's other outcomes
            log.exception("webhook delivery %s: attempt failed", c.delivery_id)
            return Outcome(None, f"internal error ({type(e).__name__})")

    # ------------------------------------------------------------------ record

    def record(self, c: Claimed, outcome: Outcome, now: datetime | None = None) -> bool:
        """Write the attempt's outcome, if this sender still holds the lease."""
        return self.record_all([(c, outcome)], now) == 1

    def record_all(self, results: list[tuple[Claimed, Outcome]],
                   now: datetime | None = None) -> int:
        """Write a batch's outcomes in one transaction (one commit, not one per delivery:
        SQLite has one writer), each only if this sender still holds its lease."""
        now = now or utcnow()
        recorded = 0
        with unit_of_work(self.maker) as s:
            for c, outcome in results:
                values = self._outcome_values(c, outcome, now)
                n = execute_rowcount(s, update(WebhookDelivery)
                                     .where(WebhookDelivery.id == c.delivery_id,
                                            WebhookDelivery.lease_owner == c.lease,
                                            WebhookDelivery.status == DeliveryStatus.pending)
                                     .values(**values)
                                     .execution_options(synchronize_session=False))
                recorded += n
                if n != 1:
                    log.warning("webhook delivery %s: lease lost before its outcome was "
                                "recorded", c.delivery_id)
                elif values.get("status") == DeliveryStatus.failed:
                    log.warning("webhook delivery %s of %s failed for good after %d attempts: "
                                "%s", c.delivery_id, c.event_id, c.attempts, outcome.error)
        return recorded

    def _outcome_values(self, c: Claimed, outcome: Outcome, now: datetime) -> dict[str, Any]:
        values: dict[str, Any] = {"lease_owner": None, "lease_until": None,
                                  "last_status_code": outcome.status_code,
                                  "last_error": outcome.error}
        if outcome.ok:
            values.update(status=DeliveryStatus.delivered, delivered_at=now)
            return values
        delay = retry_delay(c.attempts, self.settings) * random.uniform(1.0, 1.1)
        retry_at = now + timedelta(seconds=delay)
        window_end = c.event_created_at + timedelta(
            seconds=self.settings.webhook_retry_window_seconds)
        if retry_at > window_end:
            values.update(status=DeliveryStatus.failed)
        else:
            values.update(next_attempt_at=retry_at)
        return values

    # ------------------------------------------------------------------ prune

    def prune(self, now: datetime | None = None) -> int:
        """Delete events older than ``webhook_retention_days`` with no pending delivery
        (their deliveries go with them): the outbox stays bounded. Returns how many."""
        now = now or utcnow()
        cutoff = now - timedelta(days=self.settings.webhook_retention_days)
        pending = (select(WebhookDelivery.id)
                   .where(WebhookDelivery.event_id == WebhookEvent.id,
                          WebhookDelivery.status == DeliveryStatus.pending))
        with unit_of_work(self.maker) as s:
            return execute_rowcount(s, delete(WebhookEvent)
                                    .where(WebhookEvent.created_at < cutoff, ~pending.exists())
                                    .execution_options(synchronize_session=False))

    # ------------------------------------------------------------------ loop

    def run_once(self, pool: ThreadPoolExecutor | None = None) -> int:
        """Claim, send and record one batch; how many were attempted."""
        claimed = self.claim()
        if not claimed:
            return 0
        if pool is None or len(claimed) == 1:
            outcomes = [self.attempt(c) for c in claimed]
        else:
            outcomes = list(pool.map(self.attempt, claimed))
        try:
            self.record_all(list(zip(claimed, outcomes, strict=True)))
        except Exception:
            # The leases run out and the deliveries are tried again: late, never lost.
            log.exception("webhook sender: could not record %d outcomes", len(claimed))
        return len(claimed)

    def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set: send what is due, then wait ``webhook_poll_seconds``."""
        next_prune = 0.0
        with ThreadPoolExecutor(BATCH, thread_name_prefix="ftune-webhook") as pool:
            while not stop.is_set():
                try:
                    if time.monotonic() >= next_prune:
                        next_prune = time.monotonic() + PRUNE_EVERY_SECONDS
                        if pruned := self.prune():
                            log.info("webhook sender: pruned %d old events", pruned)
                    sent = self.run_once(pool)
                except Exception:
                    log.exception("webhook sender pass failed")
                    sent = 0
                if sent < BATCH:
                    stop.wait(self.settings.webhook_poll_seconds)


def start_thread(maker: sessionmaker[Session], settings: Settings,
                 stop: threading.Event) -> threading.Thread:
    """A daemon thread that sends until ``stop`` is set."""

    def loop() -> None:
        sender = Sender(maker, settings)
        try:
            sender.run(stop)
        finally:
            sender.close()

    thread = threading.Thread(target=loop, name="ftune-webhook-sender", daemon=True)
    thread.start()
    return thread
