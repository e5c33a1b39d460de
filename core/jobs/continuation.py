"""Continue from a job: ``model.from_job`` (+ ``model.step``) names another job of the same
tenant whose adapter (a checkpoint's, or the final one) is where the new job starts; for a
full fine-tune (peft method full), whose weights (a checkpoint's ``model/``, or the final
model) are the new job's starting weights, loaded as its base would be.

Adapter on adapter and full on full only. A new adapter on a full job's weights is refused:
the adapter would belong to a base that exists only on this server (its card and
adapter_config would name the original base, on which it is silently wrong). A full
fine-tune from an adapter job is refused too: it would need base + adapter merged first,
which the user can ask for explicitly (training.export_merged) and name.

What continues is the adapter: its weights initialise the new job's adapter, which then
trains with its own data, optimizer, schedule, strategy and process count (a checkpoint's
sharded optimizer state stays with the job it belongs to; a pause/resume continues that).
So the new job must build the same adapter: the same base model, task and peft settings
(peft's dropout aside, which holds no weight). A request may leave them out and get the
source's (``with_source_defaults``, before the spec is parsed).

Used at submit (every rule, each problem naming its field) and by the worker when it
resolves the run (the source's files may have been deleted since).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.models import Checkpoint, Job
from core.infra.errors import ErrorCode
from core.policy.refusal import Refusal, Refused
from core.spec import JobSpec, Problem

FROM_PARAM = "model.from_job"
STEP_PARAM = "model.step"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_DIR = "model"  # core.run.jobdir.MODEL_DIR: a full fine-tune's model, final or in a checkpoint
MODEL_CONFIG = "config.json"
# peft settings that shape no weight: they may differ between the source and the new job.
_FREE_PEFT_FIELDS = ("lora_dropout",)


@dataclass(frozen=True)
class Source:
    job: Job
    step: int | None  # None: the final adapter (or model)
    # The directory holding adapter_config.json + adapter_model.safetensors, or for a full
    # fine-tune the whole model (config, safetensors, tokenizer) as from_pretrained loads it.
    path: Path

    @property
    def full(self) -> bool:
        return _is_full(self.job)


def _is_full(job: Job) -> bool:
    return isinstance(job.spec, dict) and (job.spec.get("peft") or {}).get("method") == "full"


def _artifact(folder: Path, full: bool) -> Path | None:
    """Where a checkpoint (or final artifact) directory keeps what a new job starts from,
    if it is there: the adapter itself, or a full fine-tune's model/."""
    if full:
        model = folder if folder.name == MODEL_DIR else folder / MODEL_DIR
        return model if (model / MODEL_CONFIG).is_file() else None
    return folder if (folder / ADAPTER_CONFIG).is_file() else None


def _refused(param: str, message: str) -> Refused:
    return Refused(Refusal(ErrorCode.invalid_spec, param, message))


def _tenant_job(session: Session, tenant_id: str, job_id: str) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id))
    if job is None:  # another tenant's job reads exactly like one that does not exist
        raise _refused(FROM_PARAM, f"job {job_id} not found")
    return job


def stored_steps(session: Session, job: Job) -> list[int]:
    """The job's checkpoint steps whose adapter is still on disk."""
    root = Path(job.job_dir).resolve() if job.job_dir else None
    steps = []
    for step, path in session.execute(
        select(Checkpoint.step, Checkpoint.path)
        .where(Checkpoint.job_id == job.id)
        .order_by(Checkpoint.step)
    ):
        if root is not None and _artifact(_inside(root, path), _is_full(job)) is not None:
            steps.append(int(step))
    return steps


def _inside(root: Path, path: str) -> Path:
    p = (root / path).resolve()
    return p if p.is_relative_to(root) else root / "-outside-"


def find_source(session: Session, tenant_id: str, job_id: str, step: int | None) -> Source:
    """The source job's adapter directory, or Refused naming model.from_job / model.step."""
    job = _tenant_job(session, tenant_id, job_id)
    root = Path(job.job_dir).resolve() if job.job_dir else None
    full = _is_full(job)
    if step is None:
        folder = _inside(root, job.adapter_path) if root and job.adapter_path else None
        found = _artifact(folder, full) if folder is not None else None
        if job.status != "succeeded" or found is None:
            steps = stored_steps(session, job)
            hint = f"; give model.step, one of {steps}" if steps else ""
            what = "model" if full else "adapter"
            raise _refused(
                FROM_PARAM, f"job {job_id} is {job.status} and has no final {what}{hint}"
            )
        return Source(job, None, found)
    steps = stored_steps(session, job)
    if step not in steps:
        stored = f"its stored checkpoints are at steps {steps}" if steps else "it has none"
        raise _refused(STEP_PARAM, f"job {job_id} has no checkpoint at step {step}: {stored}")
    path = session.scalar(
        select(Checkpoint.path).where(Checkpoint.job_id == job.id, Checkpoint.step == step)
    )
    assert root is not None and path is not None  # stored_steps found its files
    found = _artifact(_inside(root, path), full)
    assert found is not None
    return Source(job, step, found)


def with_source_defaults(session: Session, tenant_id: str, body: Any) -> Any:
    """The request with model.name_or_path, model.task and peft taken from the source job
    where the request leaves them out. Anything unexpected is left for the parser (and
    ``continuation_problems``) to report."""
    if not isinstance(body, dict) or not isinstance(body.get("model"), dict):
        return body
    job_id = body["model"].get("from_job")
    if not isinstance(job_id, str):
        return body
    job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id))
    if job is None or not isinstance(job.spec, dict):
        return body
    source_model = job.spec.get("model") or {}
    model = dict(body["model"])
    for key in ("name_or_path", "task"):
        if key not in model and key in source_model:
            model[key] = source_model[key]
    out = {**body, "model": model}
    if "peft" not in body and "peft" in job.spec:
        out["peft"] = job.spec["peft"]
    return out


def continuation_problems(
    session: Session, tenant_id: str, body: Any, spec: JobSpec | None
) -> list[Problem]:
    """Every reason the request cannot continue from its model.from_job (empty: it can).
    Without a parsed ``spec`` (it has problems of its own) the source is still looked up
    from the request, so an unknown job or step is said in the same answer."""
    if spec is None:
        model = body.get("model") if isinstance(body, dict) else None
        job_id = model.get("from_job") if isinstance(model, dict) else None
        step = model.get("step") if isinstance(model, dict) else None
        if not isinstance(job_id, str) or not (step is None or isinstance(step, int)):
            return []
        try:
            find_source(session, tenant_id, job_id, step)
        except Refused as e:
            return [Problem(e.refusal.param, e.refusal.message)]
        return []
    m = spec.model
    if m.from_job is None:
        return []
    try:
        source = find_source(session, tenant_id, m.from_job, m.step)
    except Refused as e:
        return [Problem(e.refusal.param, e.refusal.message)]
    theirs = JobSpec.model_validate(source.job.spec)
    mine_full, their_full = spec.peft.method == "full", theirs.peft.method == "full"
    if mine_full != their_full:
        return [
            Problem(
                "peft.method",
                f"job {m.from_job} trained the whole model (peft method full): a job continuing "
                "it trains the whole model too (leave peft out); a new adapter on its weights "
                "is not supported (it would fit only a base that exists on this server)"
                if their_full
                else f"{spec.peft.method!r}, but job {m.from_job} trained a {theirs.peft.method} "
                "adapter: a full fine-tune does not start from an adapter (its weights would "
                "be base + adapter merged); continue the adapter (leave peft out)",
            )
        ]
    out = []
    for field in ("name_or_path", "task"):
        mine, want = getattr(m, field), getattr(theirs.model, field)
        if mine != want:
            out.append(
                Problem(
                    f"model.{field}",
                    f"{mine!r}, but job {m.from_job} trained on {want!r}: its "
                    + ("weights continue only as a fine-tune of the same base" if their_full
                       else "adapter continues only on the same base"),
                )
            )
    mine_peft = spec.peft.model_dump(mode="json", exclude=set(_FREE_PEFT_FIELDS))
    want_peft = theirs.peft.model_dump(mode="json", exclude=set(_FREE_PEFT_FIELDS))
    if mine_peft != want_peft:
        diff = sorted(k for k in mine_peft.keys() | want_peft.keys()
                      if mine_peft.get(k) != want_peft.get(k))
        out.append(
            Problem(
                "peft",
                f"{', '.join(diff)} differ from job {m.from_job}'s adapter; leave peft out to "
                "continue it as it is",
            )
        )
    return out
