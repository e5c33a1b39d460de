"""DeepSpeed runs of the tiny Llama that two test files share: tests/core/train/
test_deepspeed_runs.py (the strategy, its offload, its checkpoints and a resume) and
test_deepspeed_checkpoint_runs.py (checkpoints that resume on another process count). The
2-process ZeRO-3 LoRA run they both compare with is trained once a session (the
``zero3_lora_two`` fixture in tests/core/train/conftest.py; the two files are one
SAME_WORKER group in tests/conftest.py).

One job for all of them: a global batch of 4 (2 per device on 2 processes, or 2 x 2
accumulated on one), STEPS steps, checkpoints every SAVED.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.utils.jobdirs import launch, make_job
from tests.utils.tiny import text_rows

STEPS, SAVED = 8, 4
Z2_CPU = {"zero_stage": 2, "offload_optimizer_device": "cpu"}
Z3_CPU = {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}
LORA: dict[str, Any] = {}  # make_job's LoRA
FULL = {"method": "full"}


def ds_job(root: Path, model: Path, processes: int, peft: dict[str, Any],
           resume: Path | None = None, zero: dict[str, Any] = Z3_CPU) -> Path:
    """The job directory, not launched yet. A resumed job keeps the training section of the
    run that wrote the checkpoint (on the other count), as the scheduler's resize
    (distributed.resume_on) does: the trainer finds the accumulation that keeps the global
    batch, and DeepSpeed must follow it."""
    on_one = processes == 1 if resume is None else processes != 1
    per_rank = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2 if on_one else 1}
    return make_job(
        root,
        model,
        text_rows(64),
        spec={
            "peft": peft,
            "training": {"max_steps": STEPS, "save_steps": SAVED, "logging_steps": 1,
                         "learning_rate": 1e-3, **per_rank},
            "distributed": {"strategy": "deepspeed", "num_processes": processes,
                            "deepspeed": zero},
        },
        runtime={"resume_from_checkpoint": str(resume) if resume else None},
    )


def run(root: Path, model: Path, processes: int, peft: dict[str, Any],
        resume: Path | None = None) -> Path:
    """ds_job, launched as the worker launches it; its job directory."""
    job = ds_job(root, model, processes, peft, resume)
    launch(job, timeout=900)
    return job


def checkpoint(job: Path, step: int = SAVED) -> Path:
    return job / "checkpoints" / f"checkpoint-{step}"
