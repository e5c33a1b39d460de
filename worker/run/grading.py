"""The grading process of a GRPO run (core/graders/service.py), started by the worker before
the trainer and stopped with the run: it holds the judge endpoint's key and the python
graders' sandboxes, so the trainer (model code, user data) holds neither."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from core.graders.config import JUDGE_KEY_ENV
from core.graders.service import SOCKET_ENV
from core.run.jobdir import JobDir
from core.spec import JobSpec
from worker.run import process_tree

START_SECONDS = 60.0


class GradingDidNotStart(RuntimeError):
    pass


@dataclass
class GradingProcess:
    launched: process_tree.Launched
    folder: Path

    @property
    def socket(self) -> Path:
        return self.folder / "grading.sock"

    def trainer_env(self) -> dict[str, str]:
        """What the trainer is told: where to send its answers (and nothing else)."""
        return {SOCKET_ENV: str(self.socket)}

    def stop(self) -> None:
        try:
            process_tree.stop_tree(self.launched, grace=0)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def grades_beside(spec: JobSpec | None) -> bool:
    """Whether a run of ``spec`` has a grading process beside its trainer (GRPO's graders;
    on SLURM one per node, started by the batch script: worker/slurm/script.py)."""
    return spec is not None and spec.training.objective == "grpo" and spec.training.grpo is not None


def start_grading(spec: JobSpec | None, jd: JobDir, tag: str) -> GradingProcess | None:
    """The run's grading process, listening once this returns; None for other objectives."""
    if not grades_beside(spec):
        return None
    # A short path (unix sockets allow ~100 bytes) in a folder only this user may enter.
    folder = Path(tempfile.mkdtemp(prefix="ftune-grading-"))
    key = os.environ.get(JUDGE_KEY_ENV)
    env = process_tree.trainer_env(extra={JUDGE_KEY_ENV: key} if key else None)
    launched = process_tree.spawn(
        [sys.executable, "-m", "core.run.grading_process", str(folder / "grading.sock"),
         str(jd.spec)],
        log_path=jd.root / "grading.log", env=env, tag=tag)
    grading = GradingProcess(launched, folder)
    deadline = time.monotonic() + START_SECONDS
    while not grading.socket.exists():
        if launched.popen.poll() is not None or time.monotonic() > deadline:
            grading.stop()
            raise GradingDidNotStart(
                f"the grading process did not start (see {jd.root / 'grading.log'})")
        time.sleep(0.05)
    return grading
