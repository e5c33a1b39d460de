"""Reference runs that several test files compare with, trained once a session instead of
once a file: the fixtures in tests/core/train/conftest.py build them on first use, and the
files that share them are one SAME_WORKER group in tests/conftest.py, so that one
pytest-xdist worker trains each of them. The jobs are in tests/utils/full_runs.py,
lora_runs.py and deepspeed_runs.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class SharedRuns:
    """``runs(name)``: the job directory of the reference run ``name``, ``train(folder,
    name)`` the first time it is asked for. A DeepSpeed run only after the asking test's
    ``cpu_adam`` fixture built DeepSpeed's CPU ops (outside the run's timeout)."""

    def __init__(self, root: Path, train: Callable[[Path, str], Path]) -> None:
        self.root, self.train = root, train
        self._done: dict[str, Path] = {}

    def __call__(self, name: str) -> Path:
        if name not in self._done:
            self._done[name] = self.train(self.root / name, name)
        return self._done[name]
