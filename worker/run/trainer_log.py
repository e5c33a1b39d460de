"""Reading trainer.log: its last lines, and which rank torch elastic saw fail first."""

from __future__ import annotations

import os
import re
from pathlib import Path

LOG_TAIL_LINES = 40


def tail_lines(path: Path, n: int = LOG_TAIL_LINES, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


_ROOT_CAUSE = re.compile(r"^\s*rank\s*:\s*(\d+)\b.*?$\s*^\s*exitcode\s*:\s*(-?\d+)",
                         re.MULTILINE)


def elastic_root_cause(lines: list[str]) -> tuple[int, int] | None:
    """(rank, exit code) of the first rank to fail, from torch elastic's failure summary
    ("Root Cause (first observed failure)") at the end of a multi-process run's log."""
    text = "\n".join(lines)
    at = text.rfind("Root Cause (first observed failure)")
    if at < 0:
        return None
    m = _ROOT_CAUSE.search(text, at)
    return (int(m.group(1)), int(m.group(2))) if m else None
