"""``python -m core.run.grading_process SOCKET PLAN``: the grading process of a GRPO run,
started by the worker (worker/run/grading.py) beside the trainer. It reads the job's grader
and what it may do from the run plan (spec.json), then serves the trainer's batches on the
socket (core/graders/service.py). Its entry point lives here, above the graders, because it
reads the run plan: the graders stay below the run in core's layers."""

from __future__ import annotations

import sys
from pathlib import Path

from core.graders.service import GraderRuntime, serve
from core.run.plan import RunPlan


def main(argv: list[str]) -> None:
    plan = RunPlan.read(Path(argv[1]))
    grpo = plan.spec.training.grpo
    assert grpo is not None and plan.runtime.graders is not None
    serve(Path(argv[0]), grpo.grader, GraderRuntime.model_validate(plan.runtime.graders))


if __name__ == "__main__":
    main(sys.argv[1:])
