"""What a checkpoint is and whether a run may resume from it: the manifest
(``ftune_checkpoint.json``), the batch layout that keeps the data position on another world
size, and the refusals said before any weight is read. Torch-free and outside the trainer
package, so the scheduler, the worker and the API decide with the same rules the trainer
applies (core/train/checkpoint.py saves and loads the checkpoints themselves, and explains
the data position; core/train/deepspeed_checkpoint.py moves a ZeRO checkpoint through
DeepSpeed's universal format)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MANIFEST = "ftune_checkpoint.json"
FORMAT_DCP = "dcp"
FORMAT_DEEPSPEED = "deepspeed"
LATEST = "latest"  # DeepSpeed's file naming the engine checkpoint's tag (global_stepN)
NVME_OPTIMIZER_DIR = "offloaded_tensors"


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint is and how it was taken (``ftune_checkpoint.json``)."""

    format: str  # "dcp" | "deepspeed"
    step: int
    strategy: str
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    # "adapter": a PEFT model, only the adapter trains; "full": every parameter trains.
    trainable: str

    @property
    def global_batch(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def write(self, checkpoint: Path) -> None:
        tmp = checkpoint / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({**asdict(self), "global_batch": self.global_batch}, indent=2))
        os.replace(tmp, checkpoint / MANIFEST)

    @classmethod
    def read(cls, checkpoint: Path) -> Manifest | None:
        """The manifest, or None for a checkpoint written before manifests existed."""
        try:
            raw = json.loads((checkpoint / MANIFEST).read_text())
        except FileNotFoundError:
            return None
        fields = {k: raw[k] for k in cls.__dataclass_fields__}
        return cls(**fields)


def rebatch(global_batch: int, per_device: int, world_size: int) -> tuple[int, int] | None:
    """(per-device batch, accumulation steps) that keep ``global_batch`` on ``world_size``
    processes, or None when the global batch does not split over them.

    The per-device batch stays as asked when it divides the new per-rank share (the memory a
    rank needs does not grow); otherwise the largest smaller one that does.
    """
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    for b in range(min(per_device, per_rank), 0, -1):
        if per_rank % b == 0:
            return b, per_rank // b
    return None  # unreachable: b = 1 always divides


@dataclass(frozen=True)
class ResumePlan:
    """How this run continues a checkpoint: the batch layout to train with (the spec's, or
    one that keeps the checkpoint's global batch on another world size)."""

    checkpoint: Path
    manifest: Manifest | None
    per_device_train_batch_size: int
    gradient_accumulation_steps: int

    def event_fields(self, strategy: str, world_size: int) -> dict[str, Any]:
        """For the "started" event: what changed since the checkpoint was taken."""
        m = self.manifest
        if m is None or (m.world_size, m.strategy) == (world_size, strategy):
            return {}
        return {
            "resumed_world_size": {"from": m.world_size, "to": world_size},
            "resumed_strategy": {"from": m.strategy, "to": strategy},
            "rebatched": {
                "per_device_train_batch_size": self.per_device_train_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "global_batch": m.global_batch,
            },
        }


def resume_refusal(manifest: Manifest | None, strategy: str, world_size: int) -> str | None:
    """Why a checkpoint cannot resume with ``strategy`` on ``world_size`` processes (None: it
    can). Used by the trainer, and by the worker before it launches anything."""
    if manifest is None:
        return None  # an older checkpoint: resumes as the Trainer always did (same layout)
    same = manifest.world_size == world_size
    if (manifest.format == FORMAT_DEEPSPEED) != (strategy == "deepspeed"):
        return (
            f"a {manifest.strategy} checkpoint does not load under {strategy}: DeepSpeed "
            "checkpoints hold ZeRO's flat optimizer partitions"
        )
    # A DeepSpeed one moves to another world size through DeepSpeed's universal checkpoint
    # (core/train/deepspeed_checkpoint.py), keeping the global batch as every format does.
    if not same and manifest.global_batch % world_size:
        return (
            f"its global batch of {manifest.global_batch} (per-device batch "
            f"{manifest.per_device_train_batch_size} x accumulation "
            f"{manifest.gradient_accumulation_steps} x {manifest.world_size} processes) does "
            f"not split over {world_size} processes; the data position would be lost"
        )
    return None


def reshard_refusal(checkpoint: Path, nvme_optimizer: bool) -> str | None:
    """Why this DeepSpeed checkpoint cannot move to another process count (None: it can).
    ``nvme_optimizer``: the resumed run offloads its optimizer to NVMe."""
    if nvme_optimizer:
        return ("a run that offloads its optimizer to NVMe loads DeepSpeed checkpoints only "
                "on the process count they were taken with (its swap files are per rank)")
    tag = (checkpoint / LATEST).read_text().strip() if (checkpoint / LATEST).is_file() else None
    if tag and (checkpoint / tag / NVME_OPTIMIZER_DIR).exists():
        return ("it was taken with the optimizer offloaded to NVMe: its optimizer state is in "
                "per-rank swap files, which DeepSpeed's universal checkpoint cannot read")
    return None
