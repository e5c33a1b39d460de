"""Fixtures for trainer tests: core.train run in this process (fast: torch is imported
once), and the runs that two files compare, trained once a session."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.utils.shared_runs import SharedRuns


@pytest.fixture
def run_main() -> Iterator[Callable[[Path], int]]:
    """``core.train.__main__.main([job])`` in-process; restores the SIGTERM handler it installs."""
    from core.train.__main__ import main

    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield lambda job: main([str(job)])
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def full_runs(tiny_tied_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    """The full fine-tunes that test_full_runs.py and test_full_checkpoint_runs.py share
    (tests/utils/full_runs.py)."""
    from tests.utils.full_runs import REFERENCES, full_job

    return SharedRuns(tmp_path_factory.mktemp("full-runs"), lambda root, name: full_job(
        root, tiny_tied_causal_lm, REFERENCES[name]))


@pytest.fixture(scope="session")
def lora_runs(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    """The LoRA runs that test_checkpoint_runs.py and test_fsdp_runs.py share
    (tests/utils/lora_runs.py)."""
    from tests.utils.lora_runs import reference

    return SharedRuns(tmp_path_factory.mktemp("lora-runs"), lambda root, name: reference(
        root, tiny_causal_lm, name))


@pytest.fixture(scope="session")
def zero3_lora_two(cpu_adam: float, tiny_causal_lm: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-process ZeRO-3 LoRA run (optimizer and parameters offloaded) that
    test_deepspeed_runs.py and test_deepspeed_checkpoint_runs.py share
    (tests/utils/deepspeed_runs.py)."""
    from tests.utils.deepspeed_runs import LORA, run

    return run(tmp_path_factory.mktemp("zero3-lora-two"), tiny_causal_lm, 2, LORA)
