"""The rules of core/train/deepspeed_checkpoint.py that need no run: which DeepSpeed
checkpoint may move to another process count, and when a universal copy is complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.infra.errors import TrainFailure
from core.run.checkpoints import reshard_refusal
from core.train.deepspeed_checkpoint import engine_tag, prepare_universal, universal_ready


def engine_checkpoint(root: Path, step: int = 4) -> Path:
    """The layout DeepSpeed's save_checkpoint leaves: global_stepN/ and ``latest``."""
    (root / f"global_step{step}").mkdir(parents=True)
    (root / "latest").write_text(f"global_step{step}")
    return root


def test_a_zero_checkpoint_may_move(tmp_path: Path) -> None:
    ckpt = engine_checkpoint(tmp_path)
    assert engine_tag(ckpt) == "global_step4"
    assert reshard_refusal(ckpt, nvme_optimizer=False) is None


def test_nvme_optimizer_state_stays_on_its_process_count(tmp_path: Path) -> None:
    ckpt = engine_checkpoint(tmp_path)
    assert "NVMe" in (reshard_refusal(ckpt, nvme_optimizer=True) or "")
    (ckpt / "global_step4" / "offloaded_tensors").mkdir()
    why = reshard_refusal(ckpt, nvme_optimizer=False)
    assert why is not None and "per-rank swap files" in why
    with pytest.raises(TrainFailure, match="on another process count"):
        prepare_universal(ckpt, nvme_optimizer=False)


def test_a_universal_copy_counts_once_deepspeed_named_it(tmp_path: Path) -> None:
    ckpt = engine_checkpoint(tmp_path)
    (ckpt / "global_step4_universal" / "zero").mkdir(parents=True)
    assert not universal_ready(ckpt)  # interrupted: no latest_universal yet
    (ckpt / "latest_universal").write_text("global_step4_universal")
    assert universal_ready(ckpt)
    assert engine_tag(ckpt) == "global_step4"  # the universal copy is not the engine's
