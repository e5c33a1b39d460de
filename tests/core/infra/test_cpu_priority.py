"""core.infra.cpu_priority: a session's share of the CPU (Linux autogroups) follows the nice value of
the worker that made it. Each scenario runs in processes of its own: a nice value, once
lowered, cannot be raised back without privileges."""

from __future__ import annotations

import subprocess
import sys

from core.infra.cpu_priority import autogroup_nice
from testkit.launch import REPO_ROOT

# Lowers itself to nice 7, starts `sleep` in a session of its own, passes its nice on, and
# prints the child's session's nice value.
PASS_ON = """
import os, subprocess
from core.infra.cpu_priority import autogroup_nice, pass_on_nice
os.nice(7)
child = subprocess.Popen(["sleep", "30"], start_new_session=True)
pass_on_nice(child.pid)
print(autogroup_nice(child.pid))
child.kill()
"""

FOLLOW = """
import os
from core.infra.cpu_priority import autogroup_nice, session_follows_own_nice
os.nice(9)
session_follows_own_nice()
print(autogroup_nice())
"""


def python(script: str, own_session: bool = False) -> str:
    return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True, start_new_session=own_session).stdout.strip()


def test_a_session_started_by_a_lowered_process_gets_its_nice_value() -> None:
    assert python(PASS_ON) == "7"


def test_a_process_leading_its_session_gives_the_session_its_nice_value() -> None:
    assert python(FOLLOW, own_session=True) == "9"


def test_a_process_in_a_session_it_does_not_lead_leaves_the_session_alone() -> None:
    assert python(FOLLOW) == str(autogroup_nice())
