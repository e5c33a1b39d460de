"""The checkpoint rules that need no run (core/run/checkpoints.py, and plan_resume in
core/train/checkpoint.py): the batch layout on another world size, what may resume where,
the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.infra.errors import TrainFailure
from core.run.checkpoints import Manifest, rebatch, resume_refusal
from core.train.checkpoint import plan_resume


def manifest(fmt: str = "dcp", strategy: str = "ddp", world: int = 2, batch: int = 2,
             accumulation: int = 1) -> Manifest:
    return Manifest(fmt, 10, strategy, world, batch, accumulation, "adapter")


@pytest.mark.parametrize(
    ("global_batch", "per_device", "world", "layout"),
    [
        (4, 2, 1, (2, 2)),  # 2 processes -> 1: accumulate twice as much
        (4, 2, 4, (1, 1)),  # 2 -> 4: a smaller per-device batch, never a larger one
        (16, 4, 2, (4, 2)),
        (12, 8, 2, (6, 1)),  # the largest per-device batch <= asked that divides 6
        (6, 2, 4, None),  # 6 samples do not split over 4 processes
    ],
)
def test_rebatch_keeps_the_global_batch(
    global_batch: int, per_device: int, world: int, layout: tuple[int, int] | None
) -> None:
    got = rebatch(global_batch, per_device, world)
    assert got == layout
    if got is not None:
        assert got[0] * got[1] * world == global_batch


def test_the_same_world_size_always_resumes() -> None:
    assert resume_refusal(manifest(), "ddp", 2) is None
    assert resume_refusal(None, "fsdp", 8) is None  # a checkpoint from before manifests


def test_dcp_checkpoints_reshard_across_strategies() -> None:
    assert resume_refusal(manifest(strategy="fsdp"), "none", 1) is None
    assert resume_refusal(manifest(strategy="none", world=1, accumulation=2), "fsdp", 2) is None


def test_a_global_batch_that_does_not_split_is_refused() -> None:
    why = resume_refusal(manifest(), "ddp", 3)
    assert why is not None and "global batch of 4" in why and "3 processes" in why


def test_deepspeed_checkpoints_move_to_another_world_size_but_stay_under_deepspeed() -> None:
    ds = manifest(fmt="deepspeed", strategy="deepspeed")
    assert resume_refusal(ds, "deepspeed", 2) is None
    # Through DeepSpeed's universal checkpoint, keeping the global batch of 4.
    assert resume_refusal(ds, "deepspeed", 4) is None
    assert resume_refusal(ds, "deepspeed", 1) is None
    assert "does not split over 3" in (resume_refusal(ds, "deepspeed", 3) or "")
    assert "does not load under ddp" in (resume_refusal(ds, "ddp", 2) or "")
    assert "does not load under deepspeed" in (resume_refusal(manifest(), "deepspeed", 2) or "")


def test_plan_resume_reads_the_manifest_and_rebatches(tmp_path: Path) -> None:
    manifest(world=2, batch=2).write(tmp_path)
    assert Manifest.read(tmp_path) == manifest(world=2, batch=2)
    plan = plan_resume(tmp_path, "none", 1, per_device=2, accumulation=1)
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps) == (2, 2)
    assert plan.event_fields("none", 1)["resumed_world_size"] == {"from": 2, "to": 1}
    with pytest.raises(TrainFailure, match="does not split over 3"):
        plan_resume(tmp_path, "ddp", 3, per_device=2, accumulation=1)
