"""The warm-shutdown flag a running job watches (worker/run/watch.py, worker/slurm/run.py):
set by the Celery worker's shutdown hook (worker/queue/celery_app.py), read by the run.
Its own module so the run layer does not import the queue layer."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_shutdown = threading.Event()


def shutdown_marker(pid: int) -> Path:
    """A file the main worker process touches on shutdown, for jobs running in prefork
    children (the shutdown signal is only delivered to the main process)."""
    return Path(tempfile.gettempdir()) / f"ftune-worker-shutdown-{pid}"


def shutdown_requested() -> bool:
    if _shutdown.is_set():
        return True
    return shutdown_marker(os.getpid()).exists() or shutdown_marker(os.getppid()).exists()


def request_shutdown() -> None:
    """Called on warm shutdown: running jobs stop their trainer and go back to the queue."""
    _shutdown.set()
    try:
        shutdown_marker(os.getpid()).touch()
    except OSError:  # pragma: no cover - a read-only /tmp only loses the prefork path
        log.exception("could not write the shutdown marker")


def clear_shutdown() -> None:
    """A worker starting: no shutdown asked yet."""
    shutdown_marker(os.getpid()).unlink(missing_ok=True)
    _shutdown.clear()


def shutdown_event() -> threading.Event:
    """The flag itself, for threads that wait on it (the heartbeat)."""
    return _shutdown
