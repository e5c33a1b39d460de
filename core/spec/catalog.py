"""The base models an operator offers by name (settings ``model_catalog``): what the OpenAI
face's ``model`` and ``GET /v1/models`` name, and the defaults a job on each starts from.

Importable without torch or the web stack (settings reads it)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.spec import Task

# A catalog id goes into URLs (/v1/models/{id}) and into `ft:` model names, whose parts are
# separated by ':'.
CATALOG_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CatalogModel(BaseModel):
    """One base model: where it is, what it learns, the defaults of its jobs, what it needs."""

    model_config = ConfigDict(extra="forbid")

    location: str = Field(
        min_length=1, description="A local model directory (under an allowed model root) or a "
        "hub id, as model.name_or_path takes it.")
    task: Task = "causal_lm"
    method: Literal["supervised", "dpo"] = Field(
        default="supervised", description="The method a job without `method` uses.")
    learning_rate: float = Field(
        default=2e-4, gt=0, le=1.0,
        description="The base learning rate; an OpenAI job's learning_rate_multiplier scales "
        "it (1.0: this rate).")
    max_seq_length: int = Field(default=1024, ge=8, le=131_072,
                                description="Tokens per example of this model's jobs.")
    chat_template: str | None = Field(
        default=None, max_length=65_536,
        description="dataset.chat_template of this model's jobs: a named template (chatml) "
        "or Jinja, for a model whose own template does not write tools or tool calls.")
    peft: dict[str, Any] | None = Field(
        default=None, description="The `peft` section of this model's jobs (default: LoRA with "
        "the spec's defaults).")
    gpus: int | None = Field(
        default=None, ge=1, le=1024,
        description="Hardware: GPUs a job needs; unset: chosen from the model's memory "
        "estimate and the fleet (core/policy/placement.py).")
    gpu_memory_mb: int | None = Field(
        default=None, ge=1, description="Hardware: memory each of those GPUs needs, if known.")
    created: int = Field(default=0, ge=0, description="Unix seconds shown as the model's "
                         "`created` in GET /v1/models.")
    owned_by: str = Field(default="ftune", max_length=200)
    keep_warm: bool = Field(
        default=False, description="Serving: this model's deployment is never stopped for "
        "being idle (scale to zero skips it); started at its first request.")


def check_ids(catalog: dict[str, CatalogModel]) -> dict[str, CatalogModel]:
    bad = [k for k in catalog if not CATALOG_ID.fullmatch(k)]
    if bad:
        raise ValueError(f"FTUNE_MODEL_CATALOG: ids must match {CATALOG_ID.pattern} "
                         f"(no ':' or '/'): {bad}")
    return catalog
