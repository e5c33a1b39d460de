"""What the submit of a grpo job checks beyond the spec's own rules: the grader against
what this server can run (python graders allowed, a judge configured, the metric's data
installed), and each data row against the grader (core/data/grpo.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.data.files import DataProblem
from core.data.grpo import grpo_row_check
from core.graders.config import GraderRuntime
from core.infra.settings import Settings
from core.spec import JobSpec, Problem
from core.spec.graders import grader_problems

RowCheck = Callable[[dict[str, Any]], list[DataProblem]]


def grpo_grader_problems(spec: JobSpec, settings: Settings) -> list[Problem]:
    g = spec.training.grpo
    if spec.training.objective != "grpo" or g is None:
        return []
    can = GraderRuntime.from_settings(settings).capabilities()
    return [Problem(f"training.grpo.grader.{p.param}", p.message)
            for p in grader_problems(g.grader, can)]


def grpo_row_check_of(spec: JobSpec | None) -> RowCheck | None:
    """The row check of a grpo spec (None: the format's own)."""
    if spec is None or spec.training.objective != "grpo" or spec.training.grpo is None:
        return None
    return grpo_row_check(spec.dataset, spec.training.grpo.grader)
