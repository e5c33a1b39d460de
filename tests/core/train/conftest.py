"""Helpers for trainer tests: run core.train in this process (fast: torch is imported once)
or as a real subprocess (what the worker does)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils.jobdirs import REPO_ROOT, trainer_env


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


def _build_ops(*ops: str) -> float:
    """Build (or load from the venv's cache) DeepSpeed's CPU ops in a process of their own
    (testkit/build_ops.py, what `make test` runs beside lint); the seconds it took."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "testkit.build_ops", *ops],
        check=False,
        cwd=REPO_ROOT,
        env={**trainer_env(), "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"DeepSpeed's {ops} do not build:\n{proc.stderr[-3000:]}"
    return time.monotonic() - t0


@pytest.fixture(scope="session")
def cpu_adam() -> float:
    """DeepSpeed's CPU Adam op, and the shared-memory collectives op every multi-process run
    on the CPU accelerator loads at init (another JIT build, ~190 s on a loaded 2-core
    machine); returns the seconds it took."""
    return _build_ops("CPUAdamBuilder", "ShareMemCommBuilder")


@pytest.fixture(scope="session")
def shm_comm() -> float:
    """Only the shared-memory collectives op: what a multi-process DeepSpeed run on CPU needs
    when nothing is offloaded (no cpu_adam)."""
    return _build_ops("ShareMemCommBuilder")
