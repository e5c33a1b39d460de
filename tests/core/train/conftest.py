"""Helpers for trainer tests: run core.train in this process (fast: torch is imported once)
or as a real subprocess (what the worker does)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

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
