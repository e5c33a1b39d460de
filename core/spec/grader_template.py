"""OpenAI's grader templating: ``{{item.field}}`` (a field of the dataset row, dotted paths
into objects) and ``{{sample.output_text}}`` (the model's answer; ``sample.output_json``
parses it as JSON). Nothing else is evaluated: a tag is a dotted name, never code."""

from __future__ import annotations

import json
import re
from typing import Any

TAG = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SAMPLE_FIELDS = ("output_text", "output_json")


class TemplateError(ValueError):
    """A template names something the sample or the item does not have."""


def template_refs(text: str) -> list[tuple[str, ...]]:
    """Every tag of a template as a path: ("item", "answer"), ("sample", "output_text")."""
    return [tuple(m.group(1).split(".")) for m in TAG.finditer(text)]


def template_problems(text: str) -> list[str]:
    out: list[str] = []
    for m in TAG.finditer(text):
        path = m.group(1).split(".")
        if not all(_NAME.match(p) for p in path):
            out.append(f"{{{{{m.group(1)}}}}} is not a dotted name like item.answer")
        elif path[0] not in ("item", "sample") or len(path) < 2:
            out.append(f"{{{{{m.group(1)}}}}}: tags start with item. or sample. and name a field")
        elif path[0] == "sample" and path[1] not in SAMPLE_FIELDS:
            out.append(f"{{{{{m.group(1)}}}}}: a sample has {', '.join(SAMPLE_FIELDS)}")
        elif path[0] == "sample" and path[1] == "output_text" and len(path) > 2:
            out.append(f"{{{{{m.group(1)}}}}}: output_text is text; use sample.output_json.…")
    rest = TAG.sub("", text)
    if "{{" in rest or "}}" in rest:
        out.append("has an unbalanced {{ or }}")
    return out


def render(text: str, sample: dict[str, Any], item: dict[str, Any]) -> str:
    """The template with every tag replaced; text as is, other values as JSON."""

    def one(m: re.Match[str]) -> str:
        path = m.group(1).split(".")
        root: Any = {"item": item, "sample": sample}.get(path[0])
        value = _lookup(root, path, m.group(1))
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return TAG.sub(one, text)


def _lookup(root: Any, path: list[str], tag: str) -> Any:
    value = root
    for part in path[1:]:
        if not isinstance(value, dict) or part not in value:
            raise TemplateError(f"{{{{{tag}}}}}: no field {part!r}")
        value = value[part]
    if value is None and path[0] == "item":
        raise TemplateError(f"{{{{{tag}}}}}: the field is null")
    return value


def sample_of(output_text: str) -> dict[str, Any]:
    """The ``sample`` namespace for one completion."""
    try:
        output_json: Any = json.loads(output_text)
    except (ValueError, RecursionError):
        output_json = None
    return {"output_text": output_text, "output_json": output_json}
