"""Model names as OpenAI writes them: ``ft:<base>:<organization>:<suffix>:<job id>`` for a
fine-tuned model and ``...:ckpt-step-<N>`` for one of its checkpoints. Pure; the OpenAI face
(api/openai/mapping.py) names jobs with these, serving (core/serving/resolve.py) reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from core.spec.catalog import CatalogModel

CHECKPOINT_MARK = "ckpt-step-"


def name_part(text: str) -> str:
    """A piece of an ``ft:`` name: its separator ':' cannot appear inside one."""
    return re.sub(r"[:\s/]+", "-", text).strip("-")


def fine_tuned_model_name(base: str, organization: str, suffix: str | None, job_id: str) -> str:
    """``ft:<base>:<organization>:<suffix>:<job id>``, as OpenAI names fine-tuned models
    (``ft:gpt-4o-mini:acme:my-suffix:abc123``); the job id comes last, so the name leads
    back to its job."""
    return f"ft:{name_part(base)}:{name_part(organization)}:{name_part(suffix or '')}:{job_id}"


def checkpoint_model_name(model: str, step: int) -> str:
    return f"{model}:{CHECKPOINT_MARK}{step}"


@dataclass(frozen=True)
class FtName:
    job_id: str
    step: int | None


def parse_ft_name(name: str) -> FtName | None:
    """The job (and checkpoint step) an ``ft:`` name stands for; None if it is not one."""
    parts = name.split(":")
    if len(parts) < 5 or parts[0] != "ft":
        return None
    last = parts[-1]
    if last.startswith(CHECKPOINT_MARK):
        step = last.removeprefix(CHECKPOINT_MARK)
        if not step.isdigit() or len(parts) < 6:
            return None
        return FtName(parts[-2], int(step))
    return FtName(last, None)


def base_model_id(spec: dict[str, Any], envelope: dict[str, Any] | None,
                  catalog: dict[str, CatalogModel]) -> str:
    """The catalog id the job was made from: as asked, else the catalog entry at the spec's
    model location, else the location's last part."""
    if envelope and envelope.get("model"):
        return str(envelope["model"])
    location = str(spec.get("model", {}).get("name_or_path", ""))
    for model_id, entry in catalog.items():
        if entry.location == location:
            return model_id
    return name_part(location.rstrip("/").rsplit("/", 1)[-1]) or "model"


def model_name_of(job_id: str, name: str | None, spec: dict[str, Any],
                  envelope: dict[str, Any] | None, catalog: dict[str, CatalogModel],
                  organization: str) -> str:
    """The job's ``ft:`` name; its suffix is the OpenAI create's, or a JobSpec's name."""
    suffix = envelope.get("suffix") if envelope else name
    # A job continued from an ft: model is named after the catalog model under it.
    base = (envelope or {}).get("base") or base_model_id(spec, envelope, catalog)
    return fine_tuned_model_name(base, organization, suffix, job_id)
