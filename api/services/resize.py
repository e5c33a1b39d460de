"""A paused job continues on another slice: POST /v1/jobs/{id}/resume with num_processes
(and strategy). Checked here before the job is queued again: against the checkpoint it will
resume from (core/run/checkpoints.py: it must be reshardable there; a DeepSpeed one moves
through DeepSpeed's universal checkpoint, core/train/deepspeed_checkpoint.py), and against the
fleet with the submit stage of admission (core/policy/admission.py), so that a slice no worker
has is refused now rather than queued forever."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from api.schemas import ResumeRequest
from api.services.jobs.submit_checks import fleet_problems
from core.db.models import Job, JobEvent, Tenant, utcnow
from core.infra.errors import Conflict
from core.infra.settings import Settings
from core.run.checkpoints import Manifest, reshard_refusal, resume_refusal
from core.run.jobdir import JobDir
from core.spec import DistributedSpec, Problem, SpecError, parse_job_spec, resolved_spec

# The request's fields, by the spec field they set: a refusal names what the user sent.
_REQUEST_FIELD = {"distributed.num_processes": "num_processes",
                  "distributed.strategy": "strategy"}


def resize_paused(session: Session, job: Job, req: ResumeRequest, settings: Settings) -> None:
    """Change a paused job's process count / strategy for its next attempt; a no-op when
    the request changes nothing. SpecError (422) naming the field when it cannot."""
    if req.num_processes is None and req.strategy is None:
        return
    if job.status != "paused":
        raise Conflict(f"job {job.id} is {job.status}: only a paused job changes its slice",
                       code="job_not_resumable", param="status")
    spec = dict(job.spec)
    before = dict(spec.get("distributed") or {})
    after = {**before}
    if req.num_processes is not None:
        after["num_processes"] = req.num_processes
    if req.strategy is not None:
        after["strategy"] = req.strategy
    if after == before:
        return
    spec["distributed"] = after
    parsed = parse_job_spec(spec)  # SpecError names distributed.* (e.g. ddp needs 2)
    d = parsed.distributed
    world = d.processes
    latest = JobDir(Path(job.job_dir)).latest_checkpoint() if job.job_dir else None
    problems = []
    if latest is not None:
        manifest = Manifest.read(latest)
        refusal = resume_refusal(manifest, d.strategy, world)
        moves = manifest is not None and manifest.world_size != world
        if refusal is None and moves and d.strategy == "deepspeed":
            nvme = d.deepspeed.offload_optimizer_device == "nvme"
            refusal = reshard_refusal(latest, nvme_optimizer=nvme)
        if refusal:
            problems.append(Problem("num_processes", f"{latest.name}: {refusal}"))
    tenant = session.get(Tenant, job.tenant_id)
    assert tenant is not None
    for p in fleet_problems(session, tenant, settings, parsed):
        param = _REQUEST_FIELD.get(p.param, p.param)
        if all(q.param != param for q in problems):
            problems.append(Problem(param, p.message))
    if problems:
        raise SpecError(problems)
    old_world = DistributedSpec.model_validate(before).processes
    job.spec = parsed.model_dump(mode="json", exclude_unset=True)
    job.resolved_spec = resolved_spec(parsed)
    session.add(JobEvent(
        job_id=job.id, type="resized", created_at=utcnow(),
        message=f"continues on {world} process(es) ({d.strategy}), was {old_world}",
        data={"world_size": {"from": old_world, "to": world},
              "strategy": {"from": before.get("strategy", "none"), "to": d.strategy},
              "checkpoint": latest.name if latest else None},
    ))
    session.flush()
