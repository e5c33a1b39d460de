"""The LoRA runs of the tiny Llama that two test files compare: tests/core/train/
test_checkpoint_runs.py (checkpoints that resume on another process count) and
test_fsdp_runs.py (FSDP2 trains like DDP and saves the same adapter). Each reference run is
trained once a session (tests/utils/shared_runs.py; the ``lora_runs`` fixture).

One job for all of them: a global batch of 4 (2 per device on 2 processes, or 2 x 2
accumulated on one), STEPS steps, checkpoints every SAVED.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.utils.jobdirs import launch, make_job
from tests.utils.tiny import text_rows

STEPS, SAVED = 8, 4
ONE = {"strategy": "none", "num_processes": 1}
DDP = {"strategy": "ddp", "num_processes": 2}


def fsdp(**options: Any) -> dict[str, Any]:
    return {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2, **options}}


# Every rank reads the weights (FSDP2's cpu_ram_efficient_loading off).
FSDP2 = fsdp(cpu_ram_efficient_loading=False)
REFERENCES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # distributed, training
    "one": (ONE, {}),
    "ddp": (DDP, {}),
    # SHARDED_STATE_DICT checkpoints, and the merged model exported beside the adapter.
    "fsdp2": (FSDP2, {"export_merged": True}),
}


def lora_job(root: Path, model: Path, distributed: dict[str, Any], resume: Path | None = None,
             peft: dict[str, Any] | None = None, **training: Any) -> Path:
    """The job directory, not launched yet (``training`` over the shared options)."""
    per_rank = {"per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 2 if distributed["num_processes"] == 1 else 1}
    return make_job(
        root,
        model,
        text_rows(64),
        spec={
            "training": {"max_steps": STEPS, "save_steps": SAVED, "logging_steps": 1,
                         **per_rank, **training},
            "distributed": distributed,
            **({"peft": peft} if peft else {}),
        },
        runtime={"cpu_fsdp2": True, "resume_from_checkpoint": str(resume) if resume else None},
    )


def reference(root: Path, model: Path, name: str) -> Path:
    """REFERENCES[name], launched as the worker launches it; its job directory."""
    distributed, training = REFERENCES[name]
    job = lora_job(root, model, distributed, **training)
    launch(job)
    return job


def checkpoint(job: Path, step: int = SAVED) -> Path:
    return job / "checkpoints" / f"checkpoint-{step}"
