"""Start a process as an ordinary user, as the Docker image runs the API and the worker
(``USER ftune``): here uid 65534, which owns nothing on this machine. The tests run as root;
setpriv drops the child's uid, gid and groups before it executes anything."""

from __future__ import annotations

import os
import sys
from pathlib import Path

USER = 65534


def as_user(argv: list[str], uid: int = USER) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def user_env(**extra: str) -> dict[str, str]:
    """A small environment: no secrets of the test process, no bytecode to write (the user
    may not write the source tree)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "HF_HUB_OFFLINE": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8", **extra}


def python() -> str:
    return sys.executable


def give(path: Path, uid: int = USER) -> Path:
    """Make a test-made tree the user's (as the service's data directory is its own)."""
    for root, dirs, files in os.walk(path):
        os.chown(root, uid, uid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid)
    return path
