"""``python -m core.run.grading_process SOCKET PLAN``: the grading process of a GRPO run,
started beside the trainer: by the worker (worker/run/grading.py), or on SLURM by the batch
script on each node (worker/slurm/script.py). It reads the job's grader and what it may do
from the run plan (spec.json), then serves the trainer's batches on the socket
(core/graders/service.py). Its entry point lives here, above the graders, because it reads
the run plan: the graders stay below the run in core's layers.

The socket's folder is the worker's (a private temporary folder) or, on a SLURM node, made
here with mode 0700; one that exists must be this user's own (on a node's shared /tmp
another user could have made it first, to listen in the trainer's place). Either way it is
removed at exit. SIGTERM (a scancel) and SIGUSR1 (the batch script once its trainer step
ended: srun forwards SIGUSR1 to its tasks, but turns a SIGTERM into a kill of the step) end
it cleanly: the trainers still connected are served until they close.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from core.graders.service import GraderRuntime, serve
from core.run.plan import RunPlan

# Set by SIGTERM and SIGUSR1: serve() stops accepting and serves the open connections to
# their end. A flag, not a SystemExit raised wherever the main thread happens to be.
STOP = threading.Event()


def _terminate(signum: int, frame: FrameType | None) -> None:
    STOP.set()


def own_folder(folder: Path) -> None:
    """Make ``folder`` (mode 0700) unless it exists; one that exists and is another user's
    is refused."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        st = folder.lstat()
        if not folder.is_dir() or folder.is_symlink() or st.st_uid != os.geteuid():
            raise SystemExit(f"{folder}: exists and is not this user's own folder") from None


def main(argv: list[str]) -> None:
    socket_path, plan = Path(argv[0]), RunPlan.read(Path(argv[1]))
    grpo = plan.spec.training.grpo
    assert grpo is not None and plan.runtime.graders is not None
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGUSR1, _terminate)
    own_folder(socket_path.parent)
    try:
        serve(socket_path, grpo.grader, GraderRuntime.model_validate(plan.runtime.graders),
              stop=STOP)
    finally:
        shutil.rmtree(socket_path.parent, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
