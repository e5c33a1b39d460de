"""The worker writes what graders may do into the runtime, and its claim refuses a grpo job
whose grader the operator has since switched off (python graders, the judge)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.infra.settings import Settings
from core.policy.admission import Machine
from core.policy.refusal import Refused
from core.spec import JobSpec, parse_job_spec
from worker.run.prepare import admit, grader_runtime

PYTHON = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n"}


def grpo_spec(grader: dict[str, Any]) -> JobSpec:
    return parse_job_spec({
        "model": {"name_or_path": "m"},
        "dataset": {"file_id": "file-1", "format": "chat"},
        "training": {"objective": "grpo", "per_device_train_batch_size": 8,
                     "grpo": {"grader": grader, "num_generations": 4}},
    })


def test_a_python_grader_switched_off_since_submit_is_refused_at_claim(tmp_path: Path) -> None:
    # The claim stage of admission (core/policy/admission.py), which prepare runs first.
    settings = Settings(data_dir=tmp_path, python_graders=False)
    with pytest.raises(Refused) as e:
        admit(grpo_spec(PYTHON), settings, Machine(0))
    assert e.value.refusal.param == "training.grpo.grader.type"


def test_the_runtime_carries_the_operators_limits_and_no_key(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, python_grader_wall_seconds=3,
                        grader_judge_url="https://judge.example.com/v1",
                        grader_judge_api_key="sk-judge")
    judge = {"type": "score_model", "name": "j", "model": "m",
             "input": [{"role": "user", "content": "{{sample.output_text}}"}]}
    runtime = grader_runtime(grpo_spec(judge), settings)
    assert runtime is not None
    assert runtime["wall_seconds"] == 3 and runtime["judge_url"] == "https://judge.example.com/v1"
    assert "sk-judge" not in str(runtime)
