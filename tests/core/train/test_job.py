"""core.train.job: the trainer reads spec.json through the run plan (core/run/plan.py):
unknown keys and hand-edited specs that break a cross-field rule fail as invalid_spec, and
preflight applies admission's preflight stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.infra.errors import TrainFailure
from core.train.job import load_job, preflight


def write(job: Path, spec: dict[str, Any] | None = None, **runtime: Any) -> Path:
    job.mkdir(parents=True, exist_ok=True)
    body = {
        "spec": spec or {"model": {"name_or_path": "org/m"}, "dataset": {"path": "/d"}},
        "runtime": {"job_id": "job-1", "model_path": "org/m", "train_path": "/d", **runtime},
    }
    (job / "spec.json").write_text(json.dumps(body))
    return job


def test_an_unknown_runtime_key_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(TrainFailure) as e:
        load_job(write(tmp_path / "job", model_pth="/typo"))
    assert e.value.code == "invalid_spec" and "runtime.model_pth" in e.value.message


def test_a_hand_edit_that_breaks_a_cross_field_rule_is_refused(tmp_path: Path) -> None:
    spec = {"model": {"name_or_path": "org/m"}, "dataset": {"path": "/d"},
            "distributed": {"strategy": "none", "num_processes": 2}}
    with pytest.raises(TrainFailure) as e:
        load_job(write(tmp_path / "job", spec))
    assert e.value.code == "invalid_spec" and "distributed.num_processes" in e.value.message


def test_preflight_refuses_bf16_where_the_gpu_has_none(tmp_path: Path) -> None:
    spec = {"model": {"name_or_path": "org/m"}, "dataset": {"path": "/d"},
            "training": {"mixed_precision": "bf16"}}
    job = load_job(write(tmp_path / "job", spec, device="cuda"))
    with pytest.raises(TrainFailure) as e:
        preflight(job, cuda_available=True, bf16_ok=False)
    assert e.value.code == "unsupported_hardware"
    assert "training.mixed_precision" in e.value.message
    preflight(job, cuda_available=True, bf16_ok=True)
