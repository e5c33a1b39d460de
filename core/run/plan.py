"""The run plan: what the worker hands the trainer, and the whole of spec.json.

One pydantic model, written by the worker (worker/run/prepare.py) with ``RunPlan.write``
and read by the trainer (core/train/job.py) with ``RunPlan.read``: the same class on both
sides, unknown keys refused, so the two cannot drift apart. Its JSON Schema
(``RunPlan.model_json_schema()``) is the documentation of spec.json: docs/jobdir.md is
generated from it (``python -m core.run.plan > docs/jobdir.md``; a test compares them).

``spec`` is the JobSpec as the user gave it (fields they left unset stay unset, so the
trainer can re-run the cross-field checks on a hand-edited file); ``runtime`` is what the
worker resolved so the trainer never needs the database.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.run.jobdir import write_text_atomic
from core.spec import JobSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Runtime(_Strict):
    """What the worker resolved for this run."""

    job_id: str = Field(description="The job's id.")
    attempt: int = Field(default=1, ge=1,
                         description="1 for the first run, 2 after one requeue, ...")
    model_path: str = Field(min_length=1,
                            description="The base model: a local directory (confined to the "
                            "allowed roots) or a hub id; for a full fine-tune continuing "
                            "another job (model.from_job), that job's model directory (a "
                            "checkpoint's model/ or its final model/).")
    train_path: Path = Field(description="The training data: an upload's stored file or a "
                             "confined path.")
    eval_path: Path | None = Field(default=None, description="The evaluation data, if any.")
    resume_from_checkpoint: Path | None = Field(
        default=None, description="The checkpoint this attempt resumes from (a directory "
        "under the job's checkpoints/), or null to start fresh.")
    device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="What the worker resolved the run for; the trainer refuses "
        "a machine that does not have it (core/policy/admission.py, preflight).")
    init_adapter: Path | None = Field(
        default=None, description="model.from_job: the adapter directory (another job's "
        "checkpoint or final adapter, core/jobs/continuation.py) this job starts from; null: a "
        "fresh adapter.")
    allow_trust_remote_code: bool = Field(
        default=False, description="The operator's switch: model repository code may run.")
    cpu_fsdp2: bool = Field(
        default=False, description="The operator's switch: FSDP2 over gloo on CPU processes.")
    max_decompressed_bytes: int | None = Field(
        default=None, gt=0, description="What gzip data may expand to (the operator's bound).")
    deadline: float | None = Field(
        default=None, description="Unix time past which the trainer stops gracefully (the "
        "time limit); null on SLURM, which enforces --time itself.")
    tracking: dict[str, Any] | None = Field(
        default=None, description="Trackers and where they write, resolved from the "
        "operator's settings (core/policy/tracking.py); null: none.")
    graders: dict[str, Any] | None = Field(
        default=None, description="What a grpo job's grader may do (core/graders/config.py "
        "GraderRuntime), from the worker's settings; null for other objectives.")
    gpu_ids: list[int] = Field(
        default_factory=list, description="Physical GPU indices the scheduler placed the run "
        "on (also CUDA_VISIBLE_DEVICES); empty on a CPU run or without a placement.")
    main_process_port: int | None = Field(
        default=None, ge=1, le=65535, description="The rendezvous port the worker chose.")
    lm_head: Literal["auto", "plain"] = Field(
        default="auto", description="auto: the loss's LM head only at the positions that "
        "carry a loss, in bounded tiles, where the run allows it (core/train/loss.py); plain: "
        "the full logits of a plain transformers run (for TRL's objectives: its fused head "
        "over every position), a baseline to compare against. The started event's lm_head "
        "says which ran and why.")

    @field_validator("graders")
    @classmethod
    def _graders_are_a_grader_runtime(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        from core.graders.config import GraderRuntime

        return GraderRuntime.model_validate(v).model_dump()

    @field_validator("tracking")
    @classmethod
    def _tracking_names_its_trackers(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if not isinstance(v.get("report_to"), list):
            raise ValueError("must be an object with report_to")  # noqa: TRY004 - pydantic wants ValueError
        for name in v["report_to"]:
            if name in ("mlflow", "wandb") and not isinstance(v.get(name), dict):
                raise ValueError(f"{name} is in report_to but tracking.{name} is missing")
        return v


class RunPlan(_Strict):
    """spec.json: ``{"spec": <JobSpec>, "runtime": <Runtime>}``."""

    spec: JobSpec
    runtime: Runtime

    def to_json(self) -> str:
        # exclude_unset: the spec keeps only what the user set (see the module docstring);
        # the runtime's fields are all set by the worker.
        return self.model_dump_json(indent=2, exclude_unset=True)

    def write(self, path: Path) -> None:
        write_text_atomic(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> RunPlan:
        """Raises FileNotFoundError, or pydantic's ValidationError naming each bad field."""
        return cls.model_validate_json(path.read_text())


def schema_markdown() -> str:
    """docs/jobdir.md's section on spec.json, from the model itself."""
    schema = json.dumps(Runtime.model_json_schema(), indent=2, sort_keys=True)
    runtime = "\n".join(
        f"| `{name}` | {f.description or ''} |" for name, f in Runtime.model_fields.items()
    )
    return (
        "# spec.json: the run plan\n\n"
        "Generated from `core/run/plan.py` (`python -m core.run.plan > docs/jobdir.md`); "
        "tests/core/run/test_plan.py fails when this file and the model differ. The rest of "
        "the job directory is described in `core/run/jobdir.py`.\n\n"
        "spec.json is `{\"spec\": <JobSpec>, \"runtime\": <Runtime>}`, written by the worker "
        "and read by the trainer through the same pydantic model; unknown keys are "
        "refused.\n\n"
        "## spec\n\nThe JobSpec as submitted (fields the user left unset stay unset); its "
        "schema is the API's (`JobSpec` in /openapi.json).\n\n"
        "## runtime\n\n| field | meaning |\n| --- | --- |\n"
        f"{runtime}\n\n"
        "### JSON Schema of runtime\n\n```json\n"
        f"{schema}\n```\n"
    )


if __name__ == "__main__":
    print(schema_markdown(), end="")
