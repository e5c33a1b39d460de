"""Was the trainer killed from outside? A system fault, not the job's.

A rank that raises writes error.json and exits with a code of its own (1, 3, ...). A rank
killed from outside (the kernel's OOM killer, an operator's ``kill``, a node's shutdown) ends
by a signal and writes nothing. Only the signals something outside sends count: SIGKILL,
SIGTERM, SIGINT, SIGHUP, SIGQUIT. A trainer that dies by SIGSEGV, SIGABRT, SIGBUS, SIGFPE or
SIGILL crashed by itself (a native library's bug, torch's abort at exit) and stays failed.

Where the signal shows, by how the trainer was launched:

* several processes (torch elastic): its failure summary's root cause, ``exitcode : -9``;
* one process (accelerate's simple launcher): its CalledProcessError, ``died with
  <Signals.SIGKILL: 9>``;
* the launcher itself killed: its own exit status (negative from Popen).

The stops the worker itself makes (cancel, deadline, shutdown, pause) are decided before this
is asked (worker/run/verdict.py), so its own kills are never taken for outside ones.

The kernel's OOM record ("Killed process 1234 (python)"), where /dev/kmsg is readable (root,
or kernel.dmesg_restrict=0), names the cause when it matches the killed rank's pid.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass

OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                     signal.SIGQUIT})
_SIMPLE = re.compile(r"died with <Signals\.(SIG[A-Z0-9]+): (\d+)>")
_ELASTIC_PID = re.compile(r"exitcode\s*:\s*-\d+\s*\(pid:\s*(\d+)\)")
_OOM = re.compile(r"(?:Killed process|oom-kill:.*?pid=)\s*(\d+)")
KMSG_MAX_RECORDS = 100_000


@dataclass(frozen=True)
class OutsideKill:
    signal: str  # "SIGKILL"
    rank: int | None = None  # None: one process, or the launcher itself
    oom: bool = False  # the kernel's OOM killer did it (its record names the pid)

    def describe(self) -> str:
        who = "the trainer" if self.rank is None else f"rank {self.rank}"
        why = " by the kernel's OOM killer (the host ran out of memory)" if self.oom else ""
        return f"{who} was killed from outside with {self.signal}{why}"


def outside_kill(returncode: int | None, root_cause: tuple[int, int] | None,
                 log_lines: list[str]) -> OutsideKill | None:
    """The outside kill that ended the run, or None (it exited, or crashed by itself)."""
    if root_cause is not None:
        rank, code = root_cause
        sig = _outside(-code)
        if sig is None:
            return None
        pid = _elastic_pid(log_lines)
        return OutsideKill(sig.name, rank, oom=sig == signal.SIGKILL and pid in oom_killed())
    for line in reversed(log_lines):
        m = _SIMPLE.search(line)
        if m:
            sig = _outside(int(m.group(2)))
            return OutsideKill(sig.name) if sig is not None else None
    if returncode is not None and returncode < 0:
        sig = _outside(-returncode)
        return OutsideKill(sig.name) if sig is not None else None
    return None


def _outside(number: int) -> signal.Signals | None:
    try:
        sig = signal.Signals(number)
    except ValueError:
        return None
    return sig if sig in OUTSIDE else None


def _elastic_pid(lines: list[str]) -> int | None:
    for line in reversed(lines):
        m = _ELASTIC_PID.search(line)
        if m:
            return int(m.group(1))
    return None


def oom_killed() -> set[int]:
    """Pids the kernel's OOM killer killed, from its ring buffer; empty where unreadable."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return set()
    pids: set[int] = set()
    try:
        for _ in range(KMSG_MAX_RECORDS):
            try:
                record = os.read(fd, 8192).decode("utf-8", "replace")
            except BlockingIOError:
                break  # read to the end
            except OSError:
                continue  # EPIPE: records overwritten while reading; go on
            m = _OOM.search(record)
            if m:
                pids.add(int(m.group(1)))
    finally:
        os.close(fd)
    return pids
