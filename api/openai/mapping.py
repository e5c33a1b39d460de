"""Translation between ftune's jobs and OpenAI's objects: ids, statuses, the job object,
events, checkpoints and the results file. Pure: the service reads, these map."""

from __future__ import annotations

import csv
import io
import math
from datetime import datetime
from typing import Any

from api.openai.reinforcement import openai_reinforcement_hyperparameters
from api.openai.schemas import (
    CheckpointMetrics,
    DpoHyperparametersOut,
    DpoOut,
    FineTuningJob,
    HyperparametersOut,
    IntegrationOut,
    JobCheckpoint,
    JobErrorOut,
    JobEvent,
    MethodOut,
    OpenAIStatus,
    Placement,
    ReinforcementHyperparametersOut,
    ReinforcementOut,
    SupervisedOut,
    WandbOut,
)
from api.schemas import JobObject
from core.db.models import Checkpoint, JobStatus
from core.db.models import JobEvent as EventRow
from core.evals.job_results import result_model
from core.jobs.usage import spec_processes
from core.serving.names import (  # noqa: F401 - the OpenAI face's names, kept importable here
    FtName,
    base_model_id,
    checkpoint_model_name,
    fine_tuned_model_name,
    model_name_of,
    parse_ft_name,
)
from core.spec.catalog import CatalogModel

# Our status -> OpenAI's. OpenAI has no word for a cancel being enforced: the job is still
# running until its worker has stopped it (ftune_status says "cancelling" meanwhile), so a
# client that polls for "cancelled" sees it when the processes are gone.
STATUS: dict[str, OpenAIStatus] = {
    JobStatus.validating: "validating_files",
    JobStatus.queued: "queued",
    JobStatus.running: "running",
    JobStatus.cancelling: "running",
    JobStatus.pausing: "pausing",
    JobStatus.paused: "paused",
    JobStatus.succeeded: "succeeded",
    JobStatus.failed: "failed",
    JobStatus.cancelled: "cancelled",
}
# Which request parameter a failed job's error code points at.
ERROR_PARAMS = {"invalid_dataset": "training_file", "model_not_found": "model"}
EVENT_PREFIX = "ftevent-"
CHECKPOINT_PREFIX = "ftckpt-"
RESULTS_PREFIX = "file-results-"
JOB_PREFIX = "job-"
DEFAULT_BASE_LR = 2e-4
# training.objective -> OpenAI's method (orpo and kto have none: shown as supervised).
METHODS = {"dpo": "dpo", "grpo": "reinforcement"}


def unix(t: datetime | None) -> int | None:
    return int(t.timestamp()) if t is not None else None


def results_file_id(job_id: str) -> str:
    return RESULTS_PREFIX + job_id.removeprefix(JOB_PREFIX)


def job_of_results_file(file_id: str) -> str | None:
    if not file_id.startswith(RESULTS_PREFIX):
        return None
    return JOB_PREFIX + file_id.removeprefix(RESULTS_PREFIX)


# --------------------------------------------------------------------------- the job


def _spec_hyperparameters(spec: dict[str, Any], base_lr: float) -> dict[str, Any]:
    """What a JobSpec's training section is in OpenAI's terms (jobs made by /v1/jobs)."""
    t = spec.get("training", {})
    processes = spec_processes(spec)
    batch = (int(t.get("per_device_train_batch_size", 8))
             * int(t.get("gradient_accumulation_steps", 1)) * processes)
    out: dict[str, Any] = {
        "batch_size": batch,
        "n_epochs": math.ceil(float(t.get("num_train_epochs", 1.0))),
        "learning_rate_multiplier": round(float(t.get("learning_rate", base_lr)) / base_lr, 6),
    }
    if t.get("objective") == "dpo":
        out["beta"] = float((t.get("preference") or {}).get("beta", 0.1))
    return out


def job_to_openai(job: JobObject, envelope: dict[str, Any] | None, organization_id: str,
                  organization: str, catalog: dict[str, CatalogModel],
                  now: datetime) -> FineTuningJob:
    """Our job object (the read model) and what its OpenAI create asked for, as OpenAI's."""
    env = envelope or {}
    spec = job.spec
    base = base_model_id(spec, envelope, catalog)
    entry = catalog.get(env.get("base") or base)
    objective = spec.get("training", {}).get("objective", "sft")
    method_type = env.get("method_type") or METHODS.get(objective, "supervised")
    base_lr = entry.learning_rate if entry else DEFAULT_BASE_LR
    if method_type == "reinforcement":
        # Read back from the spec, whichever API made the job.
        hyper = openai_reinforcement_hyperparameters(spec, base_lr)
    else:
        hyper = env.get("hyperparameters") or _spec_hyperparameters(spec, base_lr)
    plain = {k: hyper[k] for k in ("batch_size", "learning_rate_multiplier", "n_epochs")
             if k in hyper}
    if method_type == "reinforcement":
        asked = env.get("hyperparameters_asked") or {}
        method = MethodOut(type="reinforcement", reinforcement=ReinforcementOut(
            grader=(spec.get("training", {}).get("grpo") or {}).get("grader") or {},
            hyperparameters=ReinforcementHyperparametersOut(
                **hyper, reasoning_effort=asked.get("reasoning_effort"))))
    elif method_type == "dpo":
        method = MethodOut(type="dpo", dpo=DpoOut(hyperparameters=DpoHyperparametersOut(**hyper)))
    else:
        method = MethodOut(type="supervised",
                           supervised=SupervisedOut(hyperparameters=HyperparametersOut(**plain)))
    status = STATUS.get(job.status, "running")
    error = None
    if job.error is not None:
        error = JobErrorOut(code=job.error.code, message=job.error.message,
                            param=ERROR_PARAMS.get(job.error.code))
    eta = job.progress.eta_seconds
    dataset = spec.get("dataset", {})
    succeeded = job.status == JobStatus.succeeded
    placement = env.get("placement")
    return FineTuningJob(
        id=job.id,
        created_at=unix(job.created_at) or 0,
        error=error,
        fine_tuned_model=(result_model(model_name_of(job.id, job.name, spec, envelope, catalog,
                                                     organization), job.evaluation)
                          if succeeded else None),
        finished_at=unix(job.finished_at),
        hyperparameters=HyperparametersOut(**plain),
        model=base,
        organization_id=organization_id,
        result_files=[results_file_id(job.id)] if succeeded else [],
        seed=int(env.get("seed", spec.get("training", {}).get("seed", 42))),
        status=status,
        trained_tokens=job.usage.trained_tokens if succeeded else None,
        training_file=str(env.get("training_file") or dataset.get("file_id")
                          or dataset.get("path") or ""),
        validation_file=env.get("validation_file") or dataset.get("eval_file_id"),
        estimated_finish=(int(now.timestamp() + eta) if eta is not None and status == "running"
                          else None),
        integrations=[IntegrationOut(wandb=WandbOut(**i["wandb"]))
                      for i in env.get("integrations") or []] or None,
        metadata=env.get("metadata"),
        method=method,
        suffix=env.get("suffix") if envelope else job.name,
        ftune_status=job.status,
        placement=Placement(**placement) if placement else None,
        ftune_notes=env.get("notes") or None,
    )


# --------------------------------------------------------------------------- events


def event_to_openai(e: EventRow) -> JobEvent:
    """Trainer progress with a loss and evaluations are "metrics" events with OpenAI's
    field names; everything else is a "message"."""
    data = dict(e.data or {})
    created = unix(e.created_at) or 0
    eid = f"{EVENT_PREFIX}{e.id}"
    if e.type == "progress" and "loss" in data:
        metrics = {"step": data.get("step"), "total_steps": data.get("total_steps"),
                   "train_loss": data.get("loss")}
        for ours, theirs in (("mean_token_accuracy", "train_mean_token_accuracy"),
                             ("learning_rate", "learning_rate"), ("epoch", "epoch"),
                             *GRPO_METRICS):
            if data.get(ours) is not None:
                metrics[theirs] = data[ours]
        message = f"Step {data.get('step')}/{data.get('total_steps')}: training loss=" \
                  f"{_num(data.get('loss'))}"
        if data.get("reward") is not None:
            message += f", reward={_num(data['reward'])}"
        return JobEvent(id=eid, created_at=created, level="info", message=message,
                        data=metrics, type="metrics")
    if e.type == "eval" and data.get("eval_loss") is not None:
        metrics = {"step": data.get("step"), "valid_loss": data.get("eval_loss")}
        if data.get("accuracy") is not None:
            metrics["valid_mean_token_accuracy"] = data["accuracy"]
        return JobEvent(id=eid, created_at=created, level="info",
                        message=f"Step {data.get('step')}: validation loss="
                                f"{_num(data.get('eval_loss'))}",
                        data=metrics, type="metrics")
    if e.type == "eval" and data.get("reward") is not None:  # grpo: held-out reward
        metrics = {"step": data.get("step"), "valid_reward_mean": data["reward"]}
        if data.get("reward_std") is not None:
            metrics["valid_reward_std"] = data["reward_std"]
        return JobEvent(id=eid, created_at=created, level="info",
                        message=f"Step {data.get('step')}: validation reward="
                                f"{_num(data['reward'])}",
                        data=metrics, type="metrics")
    level = str(data.get("level", "")).lower()
    if e.type in ("failed", "error") or level == "error":
        lvl: Any = "error"
    elif level in ("warn", "warning"):
        lvl = "warn"
    else:
        lvl = "info"
    text = e.message or _EVENT_TEXT.get(e.type, e.type)
    return JobEvent(id=eid, created_at=created, level=lvl, message=text,
                    data={"ftune_type": e.type, **data}, type="message")


# grpo progress (core/train/callbacks.py) -> the metrics of OpenAI's reinforcement events.
GRPO_METRICS = (("reward", "train_reward_mean"), ("reward_std", "train_reward_std"),
                ("completion_length", "train_completion_length"), ("kl", "train_kl"))

_EVENT_TEXT = {
    "queued": "Validated the training data; the job is queued",
    "started": "Fine-tuning job started",
    "succeeded": "The job has successfully completed",
    "cancelled": "The job was cancelled",
}


def _num(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, int | float) else str(v)


def event_id(raw: str) -> int | None:
    rest = raw.removeprefix(EVENT_PREFIX)
    return int(rest) if rest.isdigit() and raw.startswith(EVENT_PREFIX) else None


# --------------------------------------------------------------------------- checkpoints


def checkpoint_to_openai(c: Checkpoint, job_id: str, model_name: str) -> JobCheckpoint:
    m = c.metrics or {}
    return JobCheckpoint(
        id=f"{CHECKPOINT_PREFIX}{c.id}",
        created_at=unix(c.created_at) or 0,
        fine_tuned_model_checkpoint=checkpoint_model_name(model_name, c.step),
        fine_tuning_job_id=job_id,
        metrics=CheckpointMetrics(
            step=float(c.step), train_loss=m.get("loss"),
            train_mean_token_accuracy=m.get("mean_token_accuracy"),
            valid_loss=m.get("eval_loss"), full_valid_loss=m.get("eval_loss"),
            valid_mean_token_accuracy=m.get("accuracy")),
        step_number=c.step,
    )


def checkpoint_id(raw: str) -> int | None:
    rest = raw.removeprefix(CHECKPOINT_PREFIX)
    return int(rest) if rest.isdigit() and raw.startswith(CHECKPOINT_PREFIX) else None


# --------------------------------------------------------------------------- results file

RESULTS_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss",
                   "valid_mean_token_accuracy")
# A reinforcement (grpo) job's: the grader's reward, mean and spread over each logged step's
# answers, and on held-out prompts where it evaluated.
REWARD_COLUMNS = ("step", "train_loss", "train_reward_mean", "train_reward_std",
                  "valid_reward_mean")


def results_csv(events: list[EventRow]) -> bytes:
    """The step metrics as OpenAI's results file has them: one row per step that logged a
    loss, the validation loss on the steps that evaluated (empty where none); for a
    reinforcement job the rewards too."""
    rows: dict[int, dict[str, Any]] = {}
    rewarded = False
    for e in events:
        data = e.data or {}
        step = data.get("step")
        if not isinstance(step, int):
            continue
        if e.type == "progress" and data.get("loss") is not None:
            row = rows.setdefault(step, {"step": step})
            row["train_loss"] = data["loss"]
            row["train_accuracy"] = data.get("mean_token_accuracy")
            if data.get("reward") is not None:
                rewarded = True
                row["train_reward_mean"] = data["reward"]
                row["train_reward_std"] = data.get("reward_std")
        elif e.type == "eval" and data.get("eval_loss") is not None:
            row = rows.setdefault(step, {"step": step})
            row["valid_loss"] = data["eval_loss"]
            row["valid_mean_token_accuracy"] = data.get("accuracy")
        if e.type == "eval" and data.get("reward") is not None:
            rows.setdefault(step, {"step": step})["valid_reward_mean"] = data["reward"]
    columns = REWARD_COLUMNS if rewarded else RESULTS_COLUMNS
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for step in sorted(rows):
        r = rows[step]
        writer.writerow(["" if r.get(c) is None else r[c] for c in columns])
    return out.getvalue().encode()
