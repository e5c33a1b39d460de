"""CPU priority across sessions (Linux autogroups).

With sched_autogroup (on by default in many Linux kernels), the CPU is shared fairly between
sessions first, and only within a session by each process's own nice value. A new session
(``setsid``, ``start_new_session=True``) is a new autogroup at nice 0, whatever the nice value
of the process that made it. So a worker lowered with FTUNE_WORKER_NICE, whose launcher and
ranks each start sessions of their own, would otherwise compete with the API's session as if
it had no nice value at all. Elsewhere (no /proc/<pid>/autogroup) these do nothing.
"""

from __future__ import annotations

import os
from pathlib import Path


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of the autogroup (session) of ``pid``, or None where there is none."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(pid: int | str, nice: int) -> bool:
    """Set the nice value of the autogroup ``pid`` belongs to; False where there is none or
    the kernel refuses (a value below the current one needs privileges)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        return False
    return True


def session_follows_own_nice() -> None:
    """A process that leads its own session gives the session its own nice value, when that
    is lower in priority than the session's (never higher). A process in a session it does
    not lead (a terminal's) leaves the session alone."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    group = autogroup_nice()
    if nice > 0 and group is not None and group < nice and os.getsid(0) == os.getpid():
        set_autogroup_nice("self", nice)


def pass_on_nice(pid: int) -> None:
    """Give ``pid``, just started in a session of its own, this process's nice value for its
    session too (the process itself inherited it already)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:
        set_autogroup_nice(pid, nice)
