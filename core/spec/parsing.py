"""Parsing a request body into a JobSpec with every problem listed (the field checks of
the models and the cross-field checks of core/spec/checks.py, one problem per field path as
the user wrote it), reading a stored spec back, and the resolved spec a job shows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from core.spec.base import Problem, SpecError
from core.spec.checks import spec_problems
from core.spec.graders import is_union_tag
from core.spec.job import JobSpec

_PEFT_TAGS = ("lora", "ia3", "prompt_tuning", "prefix_tuning", "full")


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    # Pydantic puts union members into the location ("peft.lora.r",
    # "peft.target_modules.list[constrained-str]"); users wrote "peft.r".
    parts: list[str] = []
    for i, x in enumerate(loc):
        if isinstance(x, int):
            parts[-1:] = [f"{parts[-1]}[{x}]"] if parts else [f"[{x}]"]
            continue
        x = str(x)
        if (i == 1 and loc[0] == "peft" and x in _PEFT_TAGS) or "[" in x or x in ("str", "int"):
            continue
        if is_union_tag(loc, i):  # training.grpo.grader.<type>.field
            continue
        parts.append(x)
    return ".".join(parts) or "body"


def _merge(problems: list[Problem]) -> list[Problem]:
    """One problem per field: a union yields one error per member for the same field."""
    merged: dict[str, list[str]] = {}
    for p in problems:
        msgs = merged.setdefault(p.param, [])
        if p.message not in msgs:
            msgs.append(p.message)
    return [Problem(param, "; or ".join(msgs)) for param, msgs in merged.items()]


def parse_job_spec(data: Any) -> JobSpec:
    """Validate a request body into a JobSpec, or raise SpecError listing every problem."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        problems = [
            Problem(_loc_to_param(err["loc"]), err["msg"] + _suggestion(err)) for err in e.errors()
        ]
        raise SpecError(_merge(problems)) from None
    problems = spec_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def _suggestion(err: Any) -> str:
    """For an unknown field: "; did you mean 'x'?" naming the closest field of the model
    it was found in (pydantic says only "Extra inputs are not permitted")."""
    if err.get("type") != "extra_forbidden":
        return ""
    import difflib
    import typing

    models: list[type[BaseModel]] = [JobSpec]
    for key in err["loc"][:-1]:
        found: list[type[BaseModel]] = []
        for model in models:
            info = model.model_fields.get(str(key))
            if info is None:
                found.append(model)  # a union tag (peft's "lora"): stay on this level
                continue
            stack = [info.annotation]
            while stack:
                t = stack.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    found.append(t)
                stack.extend(typing.get_args(t))
        models = found
    names = sorted({n for model in models for n in model.model_fields})
    close = difflib.get_close_matches(str(err["loc"][-1]), names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def stored_spec(data: Any) -> JobSpec | None:
    """A spec as stored on its job row (validated at submit) parsed back, or None when it
    no longer parses (a field removed since it was queued): the claim refuses that job,
    with ``stored_spec_error``."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError:
        return None


def stored_spec_error(data: Any) -> str:
    try:
        JobSpec.model_validate(data)
    except ValidationError as e:
        return f"stored spec is invalid: {e}"
    return ""


def resolved_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec with every default that applies filled in: itself a valid spec (re-submit it
    to run the same job after a default changes).

    A full dump also holds defaults of sections the job does not use (``fsdp`` without
    strategy fsdp, FSDP1-only fields under FSDP2...), which the cross-field rules refuse as
    ignored; those rules are the one place that knows what applies, so every field they
    name is dropped until the dump validates. The request itself validated, so each such
    field is a filled-in default, never something the user set."""
    out = spec.model_dump(mode="json")
    for _ in range(8):
        try:
            parse_job_spec(out)
            return out
        except SpecError as e:
            dropped = [_drop(out, p.param) for p in e.problems]
            if not any(dropped):
                break
    return spec.model_dump(mode="json", exclude_unset=True)


def _drop(data: dict[str, Any], param: str) -> bool:
    *parents, last = param.split(".")
    node: Any = data
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False
