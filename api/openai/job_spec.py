"""The JobSpec an OpenAI fine-tuning create runs as: its method and hyperparameters (every
"auto" resolved), the spec's sections built from the request, and the way back: a problem
with a spec field named by the request field it came from."""

from __future__ import annotations

from typing import Any

from api.openai import hyperparameters as hp
from api.openai.reinforcement import (
    openai_reinforcement_fields,
    openai_reinforcement_hyperparameters,
)
from api.openai.schemas import JobCreate
from api.services.graders import checked_grader
from core.db.models import File
from core.infra.errors import InvalidRequest
from core.infra.settings import Settings
from core.policy.placement import Placement
from core.spec import SpecError
from core.spec.catalog import CatalogModel
from core.spec.grpo import GrpoSpec

# Where a problem with our spec's field lies in OpenAI's request (longest prefix first).
# The grader's own paths carry over, below method.reinforcement.grader.
GRADER_PARAM = "method.reinforcement.grader"
SPEC_PARAMS: tuple[tuple[str, str], ...] = (
    ("training.grpo.grader", GRADER_PARAM),
    ("dataset.eval_file_id", "validation_file"),
    ("dataset", "training_file"),
    ("model", "model"),
    ("training", "hyperparameters"),
    ("tracking", "integrations"),
    ("distributed", "model"),
    ("peft", "model"),
)


def _openai_param(param: str, method_type: str = "supervised") -> str | None:
    if param == "training.grpo.grader" or param.startswith("training.grpo.grader."):
        return GRADER_PARAM + param.removeprefix("training.grpo.grader")
    if param == "evaluation" or param.startswith("evaluation."):
        return param  # the extension field is the spec's section, as sent
    for prefix, theirs in SPEC_PARAMS:
        if param == prefix or param.startswith(prefix + "."):
            if theirs == "hyperparameters" and method_type != "supervised":
                return f"method.{method_type}.hyperparameters"
            return theirs
    return None


def spec_error_in_request_terms(exc: SpecError, method_type: str) -> InvalidRequest:
    """Our spec's problems in the terms of the request the user sent: the first problem's
    param mapped to OpenAI's (training_file, model, ...), every problem in details."""
    first = exc.problems[0]
    details = [{"param": _openai_param(p.param, method_type) or p.param,
                "message": f"{p.param}: {p.message}"} for p in exc.problems]
    more = f" (and {len(details) - 1} more: see details)" if len(details) > 1 else ""
    return InvalidRequest(f"{first.param}: {first.message}{more}",
                          param=_openai_param(first.param, method_type), details=details)


def method_and_hyperparameters(req: JobCreate, entry: CatalogModel) -> tuple[str, dict[str, Any]]:
    """(method type, the hyperparameters as asked, unset ones left out)."""
    if req.method is not None and req.hyperparameters is not None:
        raise InvalidRequest("give the hyperparameters under method.<type>.hyperparameters, "
                             "not also at the top level", param="hyperparameters")
    if req.method is None:
        legacy = req.hyperparameters.model_dump(exclude_none=True) if req.hyperparameters else {}
        return entry.method, legacy
    m = req.method
    sections = {"supervised": m.supervised, "dpo": m.dpo, "reinforcement": m.reinforcement}
    if any(v is not None for k, v in sections.items() if k != m.type):
        raise InvalidRequest(f"method.type is {m.type!r}: give only method.{m.type}",
                             param="method")
    section = sections[m.type]
    if m.type == "reinforcement" and section is None:
        raise InvalidRequest("method.reinforcement: the reinforcement method needs a grader "
                             "(method.reinforcement.grader)", param="method.reinforcement")
    hyper = section.hyperparameters if section is not None else None
    return m.type, hyper.model_dump(exclude_none=True) if hyper is not None else {}


def resolved_hyperparameters(method_type: str, asked: dict[str, Any], rows: int,
                             entry: CatalogModel) -> dict[str, Any]:
    """Every "auto" (or unset) hyperparameter as a number (api/openai/hyperparameters.py)."""

    def given(name: str) -> Any:
        v = asked.get(name, "auto")
        return None if v == "auto" else v

    batch = given("batch_size") or hp.auto_batch_size(rows)
    out: dict[str, Any] = {
        "batch_size": int(batch),
        "n_epochs": int(given("n_epochs") or hp.auto_n_epochs(rows)),
        "learning_rate_multiplier": float(given("learning_rate_multiplier") or 1.0),
    }
    if method_type == "dpo":
        out["beta"] = float(given("beta") or hp.DEFAULT_BETA)
    return out


def reinforcement_spec(req: JobCreate, entry: CatalogModel, asked: dict[str, Any], seed: int,
                       train: File, placement: Placement,
                       settings: Settings) -> tuple[dict[str, Any], list[str]]:
    """The grpo JobSpec a reinforcement create runs as, and what was said back about its
    hyperparameters. The grader is checked as /v1/graders/validate checks it (python graders
    need the operator's FTUNE_PYTHON_GRADERS), its problems under method.reinforcement.grader;
    the hyperparameters map as api/openai/reinforcement.py says (the learning rate multiplier
    scales the catalog model's rate, as for the other methods)."""
    assert req.method is not None and req.method.reinforcement is not None
    try:
        grader = checked_grader(req.method.reinforcement.grader, settings)
    except InvalidRequest as e:
        raise _grader_error_under_method(e) from None
    fields, said = openai_reinforcement_fields(asked, placement.num_processes,
                                               entry.learning_rate)
    refused = [n for n in said if n.refused]
    if refused:
        raise InvalidRequest(f"method.reinforcement.{refused[0]}",
                             param=f"method.reinforcement.{refused[0].param}")
    # OpenAI has no answer length: half the model's max_seq_length (the prompt has the
    # rest), at most the spec's default.
    completion = min(GrpoSpec.model_fields["max_completion_length"].default,
                     max(1, entry.max_seq_length // 2))
    training: dict[str, Any] = {
        "objective": "grpo", "seed": seed, "logging_steps": 1,
        "grpo": {"grader": grader.model_dump(mode="json"), "max_completion_length": completion},
    }
    spec: dict[str, Any] = {
        "name": req.suffix,
        "model": {"name_or_path": entry.location, "task": entry.task},
        # The reinforcement layout: chat prompts (the last message the user's) plus the
        # fields the grader reads.
        "dataset": {"file_id": req.training_file, "eval_file_id": req.validation_file,
                    "format": "chat", "max_seq_length": entry.max_seq_length},
        "training": training,
        "distributed": {"strategy": placement.strategy,
                        "num_processes": placement.num_processes},
    }
    for path, value in fields.items():
        node = spec
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    # A checkpoint per epoch (and an evaluation, with held-out prompts), as the other methods.
    echo = openai_reinforcement_hyperparameters(spec, entry.learning_rate)
    per_epoch = hp.steps_per_epoch(train.rows, echo["batch_size"])
    training["save_steps"] = per_epoch
    if req.validation_file is not None:
        training.setdefault("eval_steps", per_epoch)
    _add_catalog_and_tracking(spec, req, entry)
    return spec, [f"method.reinforcement.{n}" for n in said]


def _grader_error_under_method(e: InvalidRequest) -> InvalidRequest:
    """A grader error (paths below ``grader``) as a problem of the create's request."""
    details = [{**d, "param": f"method.reinforcement.{d['param']}"} for d in e.details or []]
    first = details[0]["param"] if details else "method.reinforcement.grader"
    message = (f"{first}: {details[0]['message']}" if len(details) == 1
               else f"method.reinforcement.grader has {len(details)} problems (see details)")
    return InvalidRequest(message, param=first, code=e.code, details=details)


def supervised_spec(req: JobCreate, entry: CatalogModel, method_type: str,
                    resolved: dict[str, Any], seed: int, train: File,
                    placement: Placement) -> dict[str, Any]:
    """The JobSpec a supervised or dpo create runs as."""
    batch = hp.split_batch(resolved["batch_size"], placement.num_processes)
    per_epoch = hp.steps_per_epoch(train.rows, resolved["batch_size"])
    training: dict[str, Any] = {
        "num_train_epochs": resolved["n_epochs"],
        "learning_rate": entry.learning_rate * resolved["learning_rate_multiplier"],
        "per_device_train_batch_size": batch.per_device,
        "gradient_accumulation_steps": batch.accumulation,
        "seed": seed,
        # OpenAI reports every step, and keeps a checkpoint per epoch.
        "logging_steps": 1,
        "save_steps": per_epoch,
    }
    if req.validation_file is not None:
        training["eval_steps"] = per_epoch
    if method_type == "dpo":
        training["objective"] = "dpo"
        training["preference"] = {"beta": resolved["beta"]}
    spec: dict[str, Any] = {
        "name": req.suffix,
        "model": {"name_or_path": entry.location, "task": entry.task},
        "dataset": {"file_id": req.training_file, "eval_file_id": req.validation_file,
                    # Detected from the rows among the layouts the objective trains on
                    # (OpenAI's chat with weights and tools, its DPO rows, ...); the job on
                    # /v1/jobs says what was detected (``data``).
                    "format": "auto",
                    "max_seq_length": entry.max_seq_length},
        "training": training,
        "distributed": {"strategy": placement.strategy,
                        "num_processes": placement.num_processes},
    }
    _add_catalog_and_tracking(spec, req, entry)
    return spec


def _add_catalog_and_tracking(spec: dict[str, Any], req: JobCreate, entry: CatalogModel) -> None:
    """What every method's spec takes from the catalog entry (its PEFT method, its chat
    template) and from the request's ``integrations``."""
    if entry.peft is not None:
        spec["peft"] = entry.peft
    if entry.chat_template is not None:
        spec["dataset"]["chat_template"] = entry.chat_template
    if (tracking := _tracking(req)) is not None:
        spec["tracking"] = tracking


def _tracking(req: JobCreate) -> dict[str, Any] | None:
    """The tracking section of a create's ``integrations`` (W&B)."""
    wandb = [i.wandb for i in req.integrations or [] if i.type == "wandb"]
    if not wandb:
        return None
    w = wandb[0]
    tags = {f"wandb.tag.{n}": t[:5000] for n, t in enumerate(w.tags or [])}
    tags["wandb.project"] = w.project
    if w.entity:
        tags["wandb.entity"] = w.entity
    return {"report_to": ["wandb"], "run_name": w.name, "tags": tags}
