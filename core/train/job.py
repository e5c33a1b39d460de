"""Reading the job: spec.json -> (JobSpec, Runtime), plus the checks that need no torch.

The worker validated the spec at submit time; it is validated again here because the
trainer can be run by hand on an edited spec.json, and a bad spec must fail as
invalid_spec, not as a crash three minutes into model loading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.jobdir import JobDir
from core.spec import JobSpec, SpecError, parse_job_spec
from core.train.failures import invalid_spec


@dataclass(frozen=True)
class Runtime:
    """What the worker resolved for this run (see core/jobdir.py for the format)."""

    job_id: str
    attempt: int
    model_path: str
    train_path: Path
    eval_path: Path | None
    resume_from_checkpoint: Path | None
    device: Literal["cpu", "cuda"]
    allow_trust_remote_code: bool
    deadline: float | None
    # The worker's operator allowed FSDP2 on CPU processes (settings.cpu_fsdp2).
    cpu_fsdp2: bool = False
    # The operator's bound on what gzip data may expand to (settings.max_decompressed_bytes).
    max_decompressed_bytes: int | None = None
    # Trackers and where they write, resolved by the worker (core/policy/tracking.py).
    tracking: dict[str, Any] | None = None
    # model.from_job: the adapter directory this job starts from (core/continuation.py).
    init_adapter: Path | None = None
    # What graders may do (core/graders/config.py GraderRuntime), from the worker's settings.
    graders: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Runtime:
        def path(key: str, required: bool = False) -> Path | None:
            v = d.get(key)
            if v is None or v == "":
                if required:
                    raise invalid_spec(f"spec.json runtime.{key} is missing")
                return None
            if not isinstance(v, str):
                raise invalid_spec(f"spec.json runtime.{key} must be a path string")
            return Path(v)

        device = d.get("device", "cpu")
        if device not in ("cpu", "cuda"):
            raise invalid_spec(f"spec.json runtime.device must be cpu or cuda, not {device!r}")
        model_path = d.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise invalid_spec("spec.json runtime.model_path is missing")
        deadline = d.get("deadline")
        train_path = path("train_path", required=True)
        assert train_path is not None
        return cls(
            job_id=str(d.get("job_id", "")),
            attempt=int(d.get("attempt", 1)),
            model_path=model_path,
            train_path=train_path,
            eval_path=path("eval_path"),
            resume_from_checkpoint=path("resume_from_checkpoint"),
            device=device,
            allow_trust_remote_code=bool(d.get("allow_trust_remote_code", False)),
            deadline=float(deadline) if deadline is not None else None,
            cpu_fsdp2=bool(d.get("cpu_fsdp2", False)),
            max_decompressed_bytes=_positive_int(d.get("max_decompressed_bytes")),
            tracking=_tracking(d.get("tracking")),
            init_adapter=path("init_adapter"),
            graders=_graders(d.get("graders")),
        )


def _tracking(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("report_to"), list):
        raise invalid_spec("spec.json runtime.tracking must be an object with report_to")
    for name in v["report_to"]:
        if name in ("mlflow", "wandb") and not isinstance(v.get(name), dict):
            raise invalid_spec(f"spec.json runtime.tracking.{name} is missing")
    return v


def _graders(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    from pydantic import ValidationError

    from core.graders.config import GraderRuntime

    try:
        return GraderRuntime.model_validate(v).model_dump()
    except ValidationError as e:
        raise invalid_spec(f"spec.json runtime.graders: {e}") from None


def _positive_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise invalid_spec(f"spec.json runtime value {v!r} must be a positive integer")
    return v


@dataclass(frozen=True)
class Job:
    dir: JobDir
    spec: JobSpec
    runtime: Runtime


def load_job(root: Path) -> Job:
    jd = JobDir(root)
    try:
        raw = json.loads(jd.spec.read_text())
    except FileNotFoundError:
        raise invalid_spec(f"{jd.spec} does not exist") from None
    except json.JSONDecodeError as e:
        raise invalid_spec(f"{jd.spec} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "spec" not in raw:
        raise invalid_spec(f'{jd.spec} must be {{"spec": ..., "runtime": ...}}')
    try:
        spec = parse_job_spec(raw["spec"])
    except SpecError as e:
        raise invalid_spec(f"spec.json: {e}") from None
    runtime = Runtime.from_dict(raw.get("runtime") or {})
    return Job(jd, spec, runtime)


def preflight(job: Job, cuda_available: bool, bf16_ok: bool = False) -> None:
    """Refuse, before any weights are loaded, what this machine cannot run honestly (the run
    policy, core/policy/, as the worker applied it; the spec may have been edited since)."""
    from core.policy import (
        bitsandbytes_installed,
        device_refusal,
        quantization_refusal,
        remote_code_refusal,
    )
    from core.train.failures import TrainFailure

    spec, rt = job.spec, job.runtime
    refusal = (
        device_refusal(
            spec, rt.device, cuda_available=cuda_available, bf16_ok=bf16_ok,
            cpu_fsdp2=rt.cpu_fsdp2,
        )
        or remote_code_refusal(spec.model, allowed=rt.allow_trust_remote_code)
        # Before any weights are read: QLoRA without bitsandbytes fails here, by name.
        or quantization_refusal(spec, bitsandbytes_installed=bitsandbytes_installed())
    )
    if refusal is not None:
        raise TrainFailure(refusal.code, str(refusal))
    asked = sorted(spec.tracking.report_to)
    resolved = sorted((rt.tracking or {}).get("report_to", []))
    if asked != resolved:
        # Where trackers write is the worker's to resolve (core/policy/tracking.py); a spec
        # edited by hand must not silently track less, or more, than it says.
        raise invalid_spec(
            f"tracking.report_to is {asked} but spec.json runtime.tracking resolves "
            f"{resolved}: let the worker write the runtime section"
        )
    if rt.resume_from_checkpoint is not None and not rt.resume_from_checkpoint.is_dir():
        raise invalid_spec(
            f"runtime.resume_from_checkpoint {rt.resume_from_checkpoint} is not a directory"
        )
