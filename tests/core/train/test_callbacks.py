"""Stop requests and the per-step NaN guard, without a training run."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from core.infra.errors import ErrorCode, TrainFailure
from core.train.callbacks import JobCallback
from core.train.events import EventLog
from core.train.stop import StopRequest


def test_stop_reasons_by_priority(tmp_path: Path) -> None:
    stop = StopRequest(tmp_path / "STOP", deadline=None)
    assert stop.local_code() == 0
    stop.signalled = True
    assert stop.local_code() == 1
    (tmp_path / "STOP").touch()
    assert stop.local_code() == 2
    stop.deadline = time.time() - 1
    assert stop.local_code() == 3


def _callback(tmp_path: Path, nonfinite: float) -> JobCallback:
    cb = JobCallback(
        EventLog(tmp_path / "events.jsonl", enabled=True),
        tmp_path,
        StopRequest(tmp_path / "STOP", deadline=None),
        started_fields={},
        task="causal_lm",
    )
    cb.trainer = SimpleNamespace(take_nonfinite=lambda: nonfinite)
    return cb


def test_non_finite_step_loss_fails_at_that_step(tmp_path: Path) -> None:
    state = TrainerState(global_step=7, max_steps=10)
    with pytest.raises(TrainFailure) as info:
        _callback(tmp_path, 1.0).on_step_end(SimpleNamespace(device="cpu"), state, TrainerControl())
    assert info.value.code == ErrorCode.nan_loss
    assert "step 7" in info.value.message


def test_stop_file_turns_into_save_and_stop(tmp_path: Path) -> None:
    (tmp_path / "STOP").touch()
    cb = _callback(tmp_path, 0.0)
    control = TrainerControl()
    cb.on_step_end(
        SimpleNamespace(device="cpu"), TrainerState(global_step=4, max_steps=10), control
    )
    assert control.should_save and control.should_training_stop and control.should_log
    assert cb.stop.reason == "stop_file"


def test_weighted_cross_entropy_normalises_by_accumulated_count() -> None:
    import torch

    from core.train.trainer import weighted_ce

    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    outputs = {"logits": logits}
    per = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    w = torch.tensor([1.0, 3.0])
    # Micro-batch of 3 inside an accumulated batch of 6 labelled examples.
    got = weighted_ce(w)(outputs, labels, num_items_in_batch=6)
    assert torch.isclose(got, (per * w[labels]).sum() / 6)
