"""The full fine-tunes (peft method full) of the tiny Llama with a tied LM head that two test
files compare: tests/core/train/test_full_runs.py (the strategies train alike and save the
same model) and test_full_checkpoint_runs.py (their checkpoints resume on another process
count). Each reference run is trained once a session (tests/utils/shared_runs.py; the
``full_runs`` fixture), where each file used to train its own DDP, FSDP1 and FSDP2 runs of
nearly the same job.

One job for all of them: a global batch of 4 (2 per device on 2 processes, or 2 x 2
accumulated on one), STEPS steps, a checkpoint at SAVED.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.utils.jobdirs import launch, make_job
from tests.utils.tiny import text_rows

STEPS, SAVED = 6, 3
ONE = {"strategy": "none", "num_processes": 1}
DDP = {"strategy": "ddp", "num_processes": 2}
# FSDP2 defaults: FULL_SHARD, cpu_ram_efficient_loading (rank 0 alone reads the weights).
FSDP2 = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2}}
# FSDP1 on CPU: torch broadcasts rank 0's weights (sync_module_states) between GPU tensors
# only, so every rank reads the weights (core/policy/hardware.py).
FSDP1 = {"strategy": "fsdp", "num_processes": 2,
         "fsdp": {"version": 1, "sync_module_states": False, "cpu_ram_efficient_loading": False}}
ZERO3_OFFLOAD = {"strategy": "deepspeed", "num_processes": 2,
                 "deepspeed": {"zero_stage": 3, "offload_optimizer_device": "cpu",
                               "offload_param_device": "cpu"}}
# ZeRO-3 without offload: the float32 partitions are their own fp32 master.
ZERO3 = {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 3}}
REFERENCES: dict[str, dict[str, Any]] = {
    "one": ONE, "ddp": DDP, "fsdp2": FSDP2, "fsdp1": FSDP1,
    "zero3_offload": ZERO3_OFFLOAD, "zero3": ZERO3,
}


def full_job(root: Path, model: Path, distributed: dict[str, Any],
             resume: Path | None = None) -> Path:
    """The job under ``distributed`` (from ``resume``'s checkpoint when given), launched as
    the worker launches it; its job directory."""
    per_rank = {"per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 2 if distributed["num_processes"] == 1 else 1}
    job = make_job(
        root, model, text_rows(48),
        spec={"peft": {"method": "full"}, "distributed": distributed,
              "training": {"max_steps": STEPS, "save_steps": SAVED, "logging_steps": 1,
                           "learning_rate": 1e-3, **per_rank}},
        runtime={"cpu_fsdp2": True, "resume_from_checkpoint": str(resume) if resume else None},
    )
    launch(job)
    return job


def checkpoint(job: Path) -> Path:
    return job / "checkpoints" / f"checkpoint-{SAVED}"
