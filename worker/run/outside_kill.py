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

Whether the kernel's OOM killer sent the SIGKILL, from what a Linux host really lets the
worker read:

* the kernel's record ("Killed process 1234 (python)") in /dev/kmsg, naming one of the
  run's pids (the worker remembers every process of the tree it saw). Readable by root only
  where kernel.dmesg_restrict=1, as on most distributions: not by the Docker image's user;
* the OOM kill counter of the memory cgroup the run's processes were in (``oom_kill`` in
  cgroup v2's memory.events, or in cgroup v1's memory.oom_control), readable by any user:
  a counter that rose while the run ran says the OOM killer killed in its cgroup (a
  container's memory limit, a systemd unit's MemoryMax). cgroup v2 counts the cgroups below
  too; v1 counts its own processes only, so the worker reads the cgroup of each process it
  saw, not only its own. A counter counts every process of its cgroup: where several runs
  share one (a worker's jobs in its container), a SIGKILL from elsewhere at the time of
  another run's OOM kill is named the OOM killer's too. Only the message depends on it: an
  outside kill resumes either way.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

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
        why = (" by the kernel's OOM killer (out of memory, on the host or under its memory "
               "cgroup's limit)" if self.oom else "")
        return f"{who} was killed from outside with {self.signal}{why}"


def outside_kill(returncode: int | None, root_cause: tuple[int, int] | None,
                 log_lines: list[str], *, pids: Collection[int] = (),
                 cgroup_oom_kills: int = 0) -> OutsideKill | None:
    """The outside kill that ended the run, or None (it exited, or crashed by itself).
    ``pids``: the run's processes the worker saw; ``cgroup_oom_kills``: OOM kills counted
    in their memory cgroups while it ran (``OomCounters.kills_since``)."""
    rank: int | None = None
    sig: signal.Signals | None = None
    if root_cause is not None:
        rank, code = root_cause
        sig = _outside(-code)
        if sig is None:
            return None
    else:
        m = next((m for line in reversed(log_lines) if (m := _SIMPLE.search(line))), None)
        if m is not None:
            sig = _outside(int(m.group(2)))
        elif returncode is not None and returncode < 0:
            sig = _outside(-returncode)
        if sig is None:
            return None
    oom = sig == signal.SIGKILL and (cgroup_oom_kills > 0 or bool(
        oom_killed() & {*pids, *filter(None, [_elastic_pid(log_lines)])}))
    return OutsideKill(sig.name, rank, oom=oom)


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


# -- the memory cgroups' OOM kill counters ------------------------------------------------


def _cgroup_mounts() -> list[tuple[str, Path, bool, set[str]]]:
    """(root, mount point, cgroup v2?, options) of each cgroup filesystem this process sees."""
    mounts = []
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            mounts.append((fields[3], Path(fields[4]), rest[0] == "cgroup2",
                           set(rest[2].split(","))))
    return mounts


def oom_counter_file(pid: int, mounts: list[tuple[str, Path, bool, set[str]]] | None = None
                     ) -> Path | None:
    """The file that counts OOM kills in ``pid``'s memory cgroup (v1 memory.oom_control or
    v2 memory.events), or None (gone, no memory controller, not Linux)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    mounts = _cgroup_mounts() if mounts is None else mounts
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for root, point, is_v2, options in mounts:
            if is_v2 != v2 or (not v2 and "memory" not in options):
                continue
            if root != "/" and not (path == root or path.startswith(root + "/")):
                continue
            rel = path[len(root):] if root != "/" else path
            f = point / rel.lstrip("/") / ("memory.events" if v2 else "memory.oom_control")
            if f.is_file():
                return f
    return None


def read_oom_kills(counter: Path) -> int | None:
    try:
        text = counter.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


class OomCounters:
    """The OOM kill counters of the memory cgroups a run's processes were seen in, each
    with its value when first seen."""

    def __init__(self) -> None:
        self.first: dict[Path, int] = {}
        self._mounts: list[tuple[str, Path, bool, set[str]]] | None = None

    def see(self, pids: Collection[int]) -> None:
        """Remember the counters of these (newly seen) processes' cgroups."""
        if self._mounts is None:
            self._mounts = _cgroup_mounts()
        for pid in pids:
            counter = oom_counter_file(pid, self._mounts)
            if counter is not None and counter not in self.first:
                value = read_oom_kills(counter)
                if value is not None:
                    self.first[counter] = value

    def kills_since(self) -> int:
        """OOM kills counted in those cgroups since each was first seen."""
        return sum(max(0, (read_oom_kills(c) or v) - v) for c, v in self.first.items())
