"""worker.queue.celery_app.lower_priority, in a process of its own (a nice value, once
lowered, cannot be raised back without privileges). Linux: /proc/self/autogroup."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit.launch import REPO_ROOT

# A thread that exists before the call, and one started after it: Linux keeps a nice value
# per thread, and the worker's pool threads start after its init.
SCRIPT = """
import json, os, sys, threading
from core.infra.cpu_priority import autogroup_nice
from worker.queue.celery_app import lower_priority

os.nice(int(sys.argv[2]))
seen = {}
before_started, go = threading.Event(), threading.Event()
def before():
    before_started.set()
    go.wait()
    seen["before"] = os.getpriority(os.PRIO_PROCESS, 0)
t = threading.Thread(target=before)
t.start()
before_started.wait()
seen["returned"] = lower_priority(int(sys.argv[1]))
go.set()
t.join()
after = threading.Thread(target=lambda: seen.update(after=os.getpriority(os.PRIO_PROCESS, 0)))
after.start()
after.join()
seen["main"] = os.getpriority(os.PRIO_PROCESS, 0)
seen["session"] = autogroup_nice()
print(json.dumps(seen))
"""


def run(nice: int, start: int, own_session: bool = False) -> dict[str, int | None]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(nice), str(start)], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True,
                         start_new_session=own_session).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def test_every_thread_now_and_later_runs_at_the_nice_value() -> None:
    seen = run(10, 0)
    # Not leading its session (a terminal's, here pytest's): the session's share is left alone.
    # A session that is no autogroup of its own (the kernel's default group, as under a CI
    # runner) has nothing to show: None.
    assert seen == {"returned": 10, "before": 10, "after": 10, "main": 10,
                    "session": seen["session"]}
    assert seen["session"] is None or seen["session"] < 10


def test_a_worker_leading_its_session_lowers_the_sessions_share() -> None:
    # As `ftune up` starts it. With sched_autogroup the CPU is shared between sessions first:
    # the threads' own nice values alone would not yield anything to the API's session.
    assert run(10, 0, own_session=True)["session"] == 10


def test_a_worker_started_lower_stays_lower() -> None:
    seen = run(10, 15)
    assert seen == {"returned": 15, "before": 15, "after": 15, "main": 15,
                    "session": seen["session"]}
