"""A memory cgroup of a test's own, below the test process's (cgroup v1 or v2, whichever holds
the memory controller here), with a limit, removed afterwards: a container's memory limit,
for the kernel's OOM killer to enforce for real."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from testkit.wait import wait_until
from worker.run.outside_kill import oom_counter_file, read_oom_kills


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    counter: Path  # memory.oom_control (v1) or memory.events (v2)

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (the shell moves itself in, then execs it:
        every process it starts is born inside)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"),
                *argv]

    def oom_kills(self) -> int:
        return read_oom_kills(self.counter) or 0

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]


def unavailable() -> str | None:
    """Why a test cannot make a memory cgroup here, or None."""
    counter = oom_counter_file(os.getpid())
    if counter is None:
        return "no memory cgroup controller visible to this process"
    if not os.access(counter.parent, os.W_OK):
        return f"{counter.parent} is not writable (needs root or a delegated cgroup)"
    return None


@contextmanager
def memory_cgroup(limit_mb: int) -> Iterator[MemoryCgroup]:
    mine = oom_counter_file(os.getpid())
    assert mine is not None, unavailable()
    path = mine.parent / f"ftune-test-{secrets.token_hex(4)}"
    path.mkdir()
    try:
        limit = str(limit_mb << 20)
        if mine.name == "memory.events":  # v2
            (path / "memory.max").write_text(limit)
            if (path / "memory.swap.max").exists():  # no swap to escape the limit into
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(limit)
        yield MemoryCgroup(path, path / mine.name)
    finally:
        for pid in MemoryCgroup(path, path / mine.name).pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), 30,
                   "the test cgroup to empty")
        path.rmdir()
