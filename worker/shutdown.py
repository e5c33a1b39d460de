"""The worker's warm-shutdown flag: set by the Celery worker on shutdown, watched by a running
job (local or SLURM) so that its trainer stops and the job goes back to the queue.

It lives apart from the Celery app so that the job path can read it without importing the
app (which imports the job path at start-up).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

shutdown_event = threading.Event()


def shutdown_marker(pid: int) -> Path:
    """A file the main worker process touches on shutdown, for jobs running in prefork
    children (the shutdown signal is only delivered to the main process)."""
    return Path(tempfile.gettempdir()) / f"ftune-worker-shutdown-{pid}"


def shutdown_requested() -> bool:
    if shutdown_event.is_set():
        return True
    return shutdown_marker(os.getpid()).exists() or shutdown_marker(os.getppid()).exists()


def request_shutdown() -> None:
    """Called on warm shutdown: running jobs stop their trainer and go back to the queue."""
    shutdown_event.set()
    try:
        shutdown_marker(os.getpid()).touch()
    except OSError:  # pragma: no cover - a read-only /tmp only loses the prefork path
        log.exception("could not write the shutdown marker")
