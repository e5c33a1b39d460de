"""Helpers for trainer tests: run core.train in this process (fast: torch is imported once)
or as a real subprocess (what the worker does)."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def run_main() -> Iterator[Callable[[Path], int]]:
    """``core.train.__main__.main([job])`` in-process; restores the SIGTERM handler it installs."""
    from core.train.__main__ import main

    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield lambda job: main([str(job)])
    finally:
        signal.signal(signal.SIGTERM, previous)


def read_error(job: Path) -> dict[str, Any]:
    return json.loads((job / "error.json").read_text())
