"""Graceful stop requests. Stdlib only: the SIGTERM handler is installed before torch and
transformers are imported (which takes seconds), so a stop during start-up is not lost."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType

__all__ = ["STOP_REASONS", "StopRequest"]

# Stop reasons, ordered: when ranks disagree, the all-reduce MAX picks the highest, so a
# passed deadline is reported as "timeout" even if a STOP file also appeared.
STOP_REASONS = {1: "signal", 2: "stop_file", 3: "timeout"}


class StopRequest:
    """A graceful stop asked for by SIGTERM, the <job_dir>/STOP file, or runtime.deadline.

    The signal handler only sets a flag (it may run between any two bytecodes, even inside
    the optimizer step); the flag is acted on at the next step boundary. Repeated SIGTERMs
    change nothing: under ``accelerate launch`` a rank typically gets two (one sent to the
    process group, one forwarded by torch's elastic agent), so "second signal = die now"
    would defeat the graceful stop. Whoever wants the process dead sends SIGKILL (the agent
    does so itself after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, default 30).
    """

    def __init__(self, stop_file: Path, deadline: float | None) -> None:
        self.stop_file = stop_file
        self.deadline = deadline
        self.signalled = False
        self.reason: str | None = None  # set once the ranks agreed to stop

    def install_signal_handler(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def local_code(self) -> int:
        """This rank's view: 0 = keep going, else a key of STOP_REASONS. Cheap: one clock
        read and one stat() per step."""
        if self.deadline is not None and time.time() >= self.deadline:
            return 3
        if self.stop_file.exists():
            return 2
        return 1 if self.signalled else 0
