"""Celery's broker side: task names, the configuration built from the settings, and an app
factory. Importing this module builds no app and connects no signal handler, so the API
(through ``core.jobs.dispatch``) can enqueue without becoming half a worker; the worker
process's app and hooks live in ``worker.queue.celery_app``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery import Celery

from core.infra.settings import Settings, get_settings

RUN_JOB_TASK = "ftune.run_job"
RECONCILE_TASK = "ftune.reconcile"
RUN_EVAL_TASK = "ftune.run_eval"
FILESYSTEM_POLL_SECONDS = 0.05


def is_filesystem_broker(url: str) -> bool:
    return url.startswith("filesystem://")


def filesystem_folders(settings: Settings) -> dict[str, Path]:
    """Producer and consumer share one message folder (kombu reads data_folder_in and
    writes data_folder_out, so both point at the same place)."""
    root = settings.broker_dir
    return {
        "data_folder_in": root / "messages",
        "data_folder_out": root / "messages",
        "processed_folder": root / "processed",
        "control_folder": root / "control",
    }


def ensure_broker_dirs(settings: Settings) -> None:
    assert settings.broker_url is not None
    if is_filesystem_broker(settings.broker_url):
        for folder in filesystem_folders(settings).values():
            folder.mkdir(parents=True, exist_ok=True)


def celery_config(settings: Settings) -> dict[str, Any]:
    assert settings.broker_url is not None
    broker_url = settings.broker_url
    is_redis = broker_url.startswith(("redis://", "rediss://", "redis+socket://"))
    if is_filesystem_broker(broker_url):
        transport_options: dict[str, Any] = {
            k: str(v) for k, v in filesystem_folders(settings).items()
        }
        transport_options["store_processed"] = False
        # kombu polls the message folder (no notification): its default of once a second
        # made an idle worker pick a job up 0.5 s after the POST on average. A listing of an
        # empty folder every 50 ms costs nothing measurable.
        transport_options["polling_interval"] = FILESYSTEM_POLL_SECONDS
    elif is_redis:
        # With early acks only a message reserved but not yet started sits in Redis' unacked
        # set; if its worker dies, Redis gives it back after this long. A duplicate delivery
        # is harmless (the claim is a guarded UPDATE), so a short-ish timeout only helps.
        transport_options = {"visibility_timeout": 3600}
    else:
        transport_options = {}
    transport_options.update(settings.broker_transport_options)
    return {
        "broker_url": broker_url,
        # The filesystem broker with atomic message files (core/infra/fs_transport.py); None:
        # the URL's scheme names the transport.
        "broker_transport": "core.infra.fs_transport:Transport"
        if is_filesystem_broker(broker_url)
        else None,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": False,
        "task_reject_on_worker_lost": False,
        "task_default_queue": settings.queue_name,
        "task_routes": {RUN_JOB_TASK: {"queue": settings.queue_name},
                        RUN_EVAL_TASK: {"queue": settings.queue_name}},
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_prefetch_multiplier": 1,
        # Redis only (Celery ignores it elsewhere, with a warning): with early acks a worker
        # would otherwise reserve the next job while it runs one.
        "worker_disable_prefetch": is_redis,
        "worker_concurrency": 1,
        # Flower / `celery events`. The filesystem transport has no event stream worth it.
        "worker_send_task_events": not is_filesystem_broker(broker_url),
        "task_send_sent_event": not is_filesystem_broker(broker_url),
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: Settings | None = None, *, include_tasks: bool = True) -> Celery:
    settings = settings or get_settings()
    app = Celery(
        "ftune",
        include=["worker.queue.tasks"] if include_tasks else [],
        set_as_current=include_tasks,
    )
    app.conf.update(celery_config(settings))
    return app
