"""The Celery app, configured from the settings.

The broker only says "job X is ready"; the database owns the job. So messages are acked as
soon as a worker starts them (``task_acks_late=False``, plus ``ack_now`` below, because the
solo pool would otherwise ack only when the task returns): a long task never outlives a
Redis visibility timeout and is never delivered twice for that reason, and a worker that
dies mid-job is found by the reconciler through its stale heartbeat, not through the broker.

``celery -A worker.queue.celery_app worker --pool=threads --concurrency=<slots>`` (``ftune
worker``) runs up to one job per slot at once, each on its own GPUs: a pool thread takes a
doorbell, the scheduler places a job on this worker's free GPUs (worker/run/claim.py), and the
thread runs it to the end. A worker with no free GPU takes doorbells and finds nothing. Importing this module builds the worker's app and connects the worker's signal
handlers; it does not import the tasks (they pull in the launcher), which the worker imports
through ``include``. The API only needs ``core.jobs.dispatch``, which uses ``core.infra.broker``
(configuration and task names) and never imports this module.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import signals

from core.infra.broker import create_app, ensure_broker_dirs
from core.infra.cpu_priority import session_follows_own_nice
from core.infra.settings import get_settings
from worker.shutdown import request_shutdown, shutdown_event, shutdown_marker

log = logging.getLogger(__name__)

app = create_app()


def _slots() -> int:
    from worker.upkeep.registry import inventory

    return inventory(get_settings()).slots


# One pool thread per slot: the worker runs that many jobs at once (``--concurrency``
# overrides it).
app.conf.worker_concurrency = _slots()


# ---------------------------------------------------------------------------------------
# Worker process hooks: broker folders, a fresh DB pool per forked child, the periodic
# reconciler thread, and setting the warm-shutdown flag (worker/shutdown.py).

_reconciler_started = threading.Lock()
_reconciler_thread: threading.Thread | None = None


@signals.setup_logging.connect
def _on_setup_logging(**_: Any) -> None:
    # Connected, this replaces Celery's own text logging: the worker's lines (claim, launch,
    # finish, Celery's task lines) are JSON with job_id, like the API's.
    from core.infra.logging import configure_logging, quiet_library_loggers

    configure_logging(get_settings().log_level, json=True)
    quiet_library_loggers()


@signals.worker_init.connect
def _on_worker_init(**_: Any) -> None:
    settings = get_settings()
    # Before the pool's threads start (they inherit it; on Linux a nice value is per thread).
    lower_priority(settings.worker_nice)
    shutdown_marker(os.getpid()).unlink(missing_ok=True)
    shutdown_event.clear()
    ensure_broker_dirs(settings)


def lower_priority(nice: int) -> int:
    """Lower this process's CPU priority to ``nice`` (never raise it: that needs privileges,
    and an operator who started the worker lower meant it) in every thread it has now; what
    it starts later inherits it (worker/run/process_tree.py passes it on to the sessions it
    starts). Returns the nice value in effect."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= current:
        return current
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: one priority for the whole process
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    # With sched_autogroup, sessions share the CPU fairly whatever their processes' nice
    # values: a worker leading its own session (as `ftune up` starts it) lowers the session's.
    session_follows_own_nice()
    return os.getpriority(os.PRIO_PROCESS, 0)


@signals.worker_process_init.connect
def _on_worker_process_init(**_: Any) -> None:
    # A forked pool child must not share the parent's pooled DB sockets.
    from core.db import session as db_session

    if db_session.get_engine.cache_info().currsize:
        db_session.get_engine().dispose(close=False)
    db_session.get_engine.cache_clear()
    db_session.get_sessionmaker.cache_clear()


@signals.celeryd_after_setup.connect
def _on_after_setup(instance: Any = None, **_: Any) -> None:
    # Beside the shared queue, this worker's own: doorbells for it alone, sent when the
    # scheduler finds a job that fits its free GPUs (worker/run/claim.py).
    from core.jobs.dispatch import worker_queue
    from worker.run.claim import worker_identity

    settings = get_settings()
    own = worker_queue(settings.queue_name, worker_identity(settings))
    instance.app.amqp.queues.select_add(own)


@signals.worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    from worker.run.claim import worker_identity
    from worker.upkeep.registry import start_heartbeat_thread

    settings = get_settings()
    start_heartbeat_thread(settings, worker_identity(settings), shutdown_event)
    # The job path's modules (claim, prepare, launch, watch), loaded now rather than by the
    # first job: their imports were ~0.7 s of its POST -> running.
    import worker.run.executor  # noqa: F401

    # Said once a doorbell would start a job at once (bench/service_overhead.py waits for it).
    log.info("ftune worker ready: database %s, broker %s, queue %s",
             redact_url(str(settings.database_url)), redact_url(str(settings.broker_url)),
             settings.queue_name)

    start_reconciler_thread()
    from worker.serve.supervisor import start_thread as start_serving

    start_serving(settings, worker_identity(settings), shutdown_event)
    if settings.webhook_sender_in_worker:
        start_webhook_sender_thread()
    from core.db.session import get_sessionmaker
    from worker.upkeep import retention

    retention.start_thread(get_sessionmaker, settings, shutdown_event)  # when any is set
    # Jobs may have queued while no worker was up (their doorbells went to others or were
    # lost): look once now.
    try:
        from worker.run.claim import ring_workers_with_work

        ring_workers_with_work(settings)
    except Exception:
        log.exception("could not look for waiting jobs at start")


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced by ``***``: fit for a log line."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port is not None else ""
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:
        return "<unparsable URL>"


@signals.task_prerun.connect
def _on_task_prerun(task: Any = None, **_: Any) -> None:
    ack_now(task)


def ack_now(task: Any) -> None:
    """Acknowledge the running task's message in Redis now, as ``task_acks_late=False``
    promises but the solo pool does not do: Celery hands the ack to the worker's event loop,
    which the task blocks, so the ack happens only when the task returns. Until then the
    message sits in Redis' unacked set, and once the visibility timeout passes any other
    worker's periodic sweep delivers it again (seen here: celery 5.7, kombu 5.7).

    Done as kombu's own ack does it (drop the delivery tag from the unacked hash and index),
    so kombu's later ack finds nothing left to do. Never raises: a duplicate delivery is
    harmless anyway (the claim is a guarded UPDATE); this only keeps it from happening."""
    try:
        props = getattr(task.request, "properties", None) or {}
        tag = props.get("delivery_tag")
        if not tag or task.request.is_eager:
            return
        with task.app.connection_for_write() as conn:
            if conn.transport.driver_type != "redis":
                return
            channel = conn.default_channel
            channel.client.pipeline() \
                .zrem(channel.unacked_index_key, tag) \
                .hdel(channel.unacked_key, tag) \
                .execute()
    except Exception:
        log.warning("could not acknowledge the task message early; a redelivery after the "
                    "visibility timeout will be skipped by the claim", exc_info=True)


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    request_shutdown()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    shutdown_marker(os.getpid()).unlink(missing_ok=True)
    from worker.run.claim import worker_identity
    from worker.serve.supervisor import stop_engines
    from worker.upkeep.registry import mark_stopped

    stop_engines()

    settings = get_settings()
    try:
        mark_stopped(settings, worker_identity(settings))
    except Exception:  # the database may be what stopped us; the reconciler says "lost" then
        log.warning("could not mark this worker stopped", exc_info=True)


def start_reconciler_thread() -> threading.Thread:
    """One daemon thread per worker process runs the reconciler every interval (with
    jitter, so many workers do not hit the DB in step). Safe beside other reconcilers."""
    global _reconciler_thread
    with _reconciler_started:
        if _reconciler_thread is not None and _reconciler_thread.is_alive():
            return _reconciler_thread
        interval = get_settings().reconcile_interval_seconds

        def loop() -> None:
            from worker.upkeep.reconciler import reconcile

            while not shutdown_event.wait(interval * random.uniform(0.8, 1.2)):
                try:
                    reconcile()  # logs what it did
                except Exception:
                    log.exception("reconciler pass failed")

        _reconciler_thread = threading.Thread(target=loop, name="ftune-reconciler", daemon=True)
        _reconciler_thread.start()
        return _reconciler_thread


_webhook_sender_thread: threading.Thread | None = None


def start_webhook_sender_thread() -> threading.Thread:
    """The webhook sender beside the reconciler (worker/upkeep/webhook_sender.py): every worker
    sends, so the embedded stack needs no process of its own. Safe beside other senders."""
    global _webhook_sender_thread
    with _reconciler_started:
        if _webhook_sender_thread is not None and _webhook_sender_thread.is_alive():
            return _webhook_sender_thread
        from core.db.session import get_sessionmaker
        from worker.upkeep.webhook_sender import start_thread

        _webhook_sender_thread = start_thread(get_sessionmaker(), get_settings(), shutdown_event)
        return _webhook_sender_thread
