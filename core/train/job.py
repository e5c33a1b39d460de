"""Reading the job: spec.json (the run plan, core/run/plan.py) -> (JobSpec, Runtime), plus
the checks that need no torch.

The API validated the spec at submit time; it is validated again here because the
trainer can be run by hand on an edited spec.json, and a bad spec must fail as
invalid_spec, not as a crash three minutes into model loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from core.infra.errors import invalid_spec
from core.run.jobdir import JobDir
from core.run.plan import RunPlan, Runtime
from core.spec import JobSpec, SpecError, spec_problems

__all__ = ["Job", "Runtime", "load_job", "preflight"]


@dataclass(frozen=True)
class Job:
    dir: JobDir
    spec: JobSpec
    runtime: Runtime


def load_job(root: Path) -> Job:
    jd = JobDir(root)
    try:
        plan = RunPlan.read(jd.spec)
    except FileNotFoundError:
        raise invalid_spec(f"{jd.spec} does not exist") from None
    except ValidationError as e:
        raise invalid_spec(f"spec.json: {_problems(e)}") from None
    # Field by field the plan validated; the cross-field rules run on what the user set.
    problems = spec_problems(plan.spec)
    if problems:
        raise invalid_spec(f"spec.json: {SpecError(problems)}")
    return Job(jd, plan.spec, plan.runtime)


def _problems(e: ValidationError) -> str:
    """pydantic's errors as "where: what", one per problem (the JSON itself may not parse)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}" for err in e.errors()
    )


def preflight(job: Job, cuda_available: bool, bf16_ok: bool = False) -> None:
    """Refuse, before any weights are loaded, what this machine cannot run honestly: the
    preflight stage of admission (core/policy/admission.py; the spec may have been edited
    since the worker's claim stage)."""
    from core.infra.errors import TrainFailure
    from core.policy import admission

    spec, rt = job.spec, job.runtime
    refusals = admission.preflight(
        spec, allow_remote_code=rt.allow_trust_remote_code,
        device=admission.Device(rt.device, cuda_available=cuda_available, bf16_ok=bf16_ok,
                                cpu_fsdp2=rt.cpu_fsdp2))
    if refusals:
        raise TrainFailure(refusals[0].code, str(refusals[0]))
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
