"""core.run.plan: spec.json is one model, written and read by the same class, unknown keys
refused, and docs/jobdir.md is generated from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.run.plan import RunPlan, Runtime, schema_markdown
from core.spec import parse_job_spec

REPO = Path(__file__).resolve().parents[3]


def plan(tmp_path: Path) -> RunPlan:
    spec = parse_job_spec({"model": {"name_or_path": "org/m"}, "dataset": {"path": "/d"},
                           "training": {"max_steps": 3}})
    runtime = Runtime(job_id="job-1", attempt=2, model_path="org/m",
                      train_path=tmp_path / "train.jsonl", device="cpu", deadline=None,
                      resume_from_checkpoint=tmp_path / "checkpoints" / "checkpoint-3")
    return RunPlan(spec=spec, runtime=runtime.model_copy(update={"gpu_ids": [0, 1]}))


def test_what_is_written_is_what_is_read(tmp_path: Path) -> None:
    p = plan(tmp_path)
    p.write(tmp_path / "spec.json")
    assert RunPlan.read(tmp_path / "spec.json") == p
    written = json.loads((tmp_path / "spec.json").read_text())
    # The spec keeps only what the user set, so the trainer's cross-field checks see it as
    # submitted; the runtime is written whole.
    assert written["spec"] == {"model": {"name_or_path": "org/m"}, "dataset": {"path": "/d"},
                               "training": {"max_steps": 3}}
    assert written["runtime"]["gpu_ids"] == [0, 1]


@pytest.mark.parametrize("where", ["top", "runtime", "spec"])
def test_unknown_keys_are_refused(tmp_path: Path, where: str) -> None:
    body = json.loads(plan(tmp_path).to_json())
    target = {"top": body, "runtime": body["runtime"], "spec": body["spec"]}[where]
    target["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        RunPlan.model_validate_json(json.dumps(body))


def test_the_jobdir_docs_are_generated_from_the_model() -> None:
    # Regenerate with: .venv/bin/python -m core.run.plan > docs/jobdir.md
    assert (REPO / "docs" / "jobdir.md").read_text() == schema_markdown()
