"""One way for every benchmark to keep what it measured: a JSON record under bench/results/.

Each record carries the machine it ran on and the load average at the time, because on a
shared machine a figure without its load cannot be compared with another one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def machine() -> dict[str, Any]:
    """Where a figure was taken: platform, CPU count and the 1/5/15-minute load average."""
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def write_record(
    name: str,
    results: Any,
    *,
    args: argparse.Namespace | dict[str, Any] | None = None,
    folder: Path | None = None,
    path: Path | None = None,
    **extra: Any,
) -> Path:
    """Write ``{"args", "machine", "results", **extra}`` to ``<folder>/<name>-<time>.json``
    (or to ``path`` when a script takes a fixed --out file), print where, and return it."""
    if path is None:
        path = (folder or RESULTS) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "args": vars(args) if isinstance(args, argparse.Namespace) else (args or {}),
        "machine": machine(),
        "results": results,
        **extra,
    }
    path.write_text(json.dumps(record, indent=2, default=str))
    try:
        shown: Path = path.resolve().relative_to(REPO)
    except ValueError:
        shown = path
    print(f"wrote {shown}")
    return path
