"""The trainer dies with its parent. Stdlib only: started before torch is imported.

The worker starts ``accelerate launch`` with PR_SET_PDEATHSIG, so a SIGKILLed worker takes
the launcher down with it. The ranks are the launcher's children, not the worker's: with
more than one process torch's elastic agent stops them on its way out, but the
single-process launcher just dies and leaves its one rank running, re-parented, still
writing checkpoints into a job directory that another worker may soon resume from.

So every rank watches its parent: once ``os.getppid()`` changes, the parent is gone. The
rank is asked to stop gracefully (it may still save a checkpoint at the next step
boundary, which the next attempt resumes from) and is hard-exited if it has not finished
within a bound:

* ``FTUNE_ORPHAN_GRACE_SECONDS`` when nobody asked for the stop (the parent just died);
  the worker sets it well below its heartbeat timeout, so the orphan is gone before the
  reconciler can hand the job to another worker.
* ``FTUNE_STOP_GRACE_SECONDS`` when the STOP file exists: the worker asked for a graceful
  stop (cancel, timeout, shutdown) and the launcher died of the same SIGTERM; the worker
  itself SIGKILLs whatever is left after its grace period.

Polling (twice a second) rather than PR_SET_PDEATHSIG: that signal fires when the *thread*
that forked the process exits, which need not be the parent's death.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ORPHAN_GRACE_ENV = "FTUNE_ORPHAN_GRACE_SECONDS"
STOP_GRACE_ENV = "FTUNE_STOP_GRACE_SECONDS"
DEFAULT_ORPHAN_GRACE = 10.0
DEFAULT_STOP_GRACE = 60.0
EXIT_ORPHANED = 1
POLL_SECONDS = 0.5


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value >= 0 else default


def watch_parent(
    on_orphaned: Callable[[], None], stop_file: Path | None = None, *, poll: float = POLL_SECONDS
) -> threading.Thread:
    """Start a daemon thread that calls ``on_orphaned()`` (ask for a graceful stop) once the
    parent process is gone, then ``os._exit`` after the grace bound if still running."""
    parent = os.getppid()

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        asked = stop_file is not None and stop_file.exists()
        bound = (
            _seconds(STOP_GRACE_ENV, DEFAULT_STOP_GRACE)
            if asked
            else _seconds(ORPHAN_GRACE_ENV, DEFAULT_ORPHAN_GRACE)
        )
        sys.stderr.write(
            f"parent process {parent} is gone; stopping (exit in at most {bound:g} s)\n"
        )
        sys.stderr.flush()
        try:
            on_orphaned()
        except Exception as e:  # noqa: BLE001 - the hard exit below must still happen
            sys.stderr.write(f"could not request a graceful stop: {e!r}\n")
        time.sleep(bound)
        sys.stderr.write(f"still running {bound:g} s after the parent died: exiting now\n")
        sys.stderr.flush()
        os._exit(EXIT_ORPHANED)

    t = threading.Thread(target=loop, name="ftune-lifeline", daemon=True)
    t.start()
    return t
