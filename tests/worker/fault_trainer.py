"""core.train with a fault injected, for fault tests: run by the worker in place of
``core.train`` (``FTUNE_TRAINER_MODULE=tests.worker.fault_trainer``), under the same
``accelerate launch``. Product code has no test hooks: this module monkeypatches a method
of the real trainer, then calls the real ``core.train`` main.

The fault comes from ``FTUNE_TRAINER_FAULT`` or, so that one worker pool can serve many
scenarios, from the job's name ``fault:<kind>[+<kind>...][:label]``:

    oom         torch.OutOfMemoryError in the training step (step 1)
    nan         the loss becomes NaN (from step 1)
    disk_full   OSError(ENOSPC) when the first checkpoint is written
    rank_crash  rank 1 calls os._exit(1) in its training step at step 2 (2-process DDP)
    slow        every training step takes at least 0.3 s more (to stop or kill mid-run)
    none        no fault

A job named ``fake:<mode>`` is handed to testkit.fake_trainer instead.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

STEP_DELAY = 0.3


def faults_for(name: str) -> set[str]:
    chosen = os.environ.get("FTUNE_TRAINER_FAULT")
    if not chosen and name.startswith("fault:"):
        chosen = name.split(":")[1]  # fault:<kind>[+<kind>][:label]
    return {f for f in (chosen or "").split("+") if f and f != "none"}


def inject(faults: set[str]) -> None:
    import torch

    from core.train.trainer import JobTrainer

    unknown = faults - {"oom", "nan", "disk_full", "rank_crash", "slow"}
    if unknown:
        raise SystemExit(f"fault_trainer: unknown fault(s) {sorted(unknown)}")
    step_fn = JobTrainer.training_step
    loss_fn = JobTrainer.compute_loss
    save_fn = JobTrainer._save_checkpoint

    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = int(self.state.global_step)
        if "slow" in faults:
            time.sleep(STEP_DELAY)
        if "oom" in faults and step >= 1:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (injected by fault_trainer)")
        if "rank_crash" in faults and step >= 2 and os.environ.get("RANK") == "1":
            sys.stderr.write("fault_trainer: rank 1 dies now (os._exit(1))\n")
            sys.stderr.flush()
            os._exit(1)
        return step_fn(self, *args, **kwargs)

    def compute_loss(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = loss_fn(self, *args, **kwargs)
        if "nan" in faults and int(self.state.global_step) >= 1:
            if isinstance(out, tuple):
                return (out[0] * float("nan"), *out[1:])
            return out * float("nan")
        return out

    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "disk_full" in faults:
            path = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save_fn(self, *args, **kwargs)

    JobTrainer.training_step = training_step  # type: ignore[method-assign]
    JobTrainer.compute_loss = compute_loss  # type: ignore[method-assign]
    JobTrainer._save_checkpoint = save_checkpoint  # type: ignore[method-assign]


def main() -> int:
    import json

    root = Path(sys.argv[1])
    name = str(json.loads((root / "spec.json").read_text())["spec"].get("name") or "")
    if name.startswith("fake:"):
        from testkit import fake_trainer

        return fake_trainer.main()
    faults = faults_for(name)
    if faults:
        inject(faults)
    from core.train.__main__ import main as train_main

    return train_main([str(root)])


if __name__ == "__main__":
    sys.exit(main())
