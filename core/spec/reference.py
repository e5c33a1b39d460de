"""docs/spec.md, the job spec's reference, written from the JobSpec model's JSON Schema.

The descriptions on the spec's fields are the documentation (they are also the API's
OpenAPI docs at /docs); this module only lays them out as tables, one per section, in the
order a reader meets them from the top of a spec. Regenerate after changing a field:
``python -m core.spec.reference > docs/spec.md`` (tests/core/spec/test_reference.py fails
while the file is stale).
"""

from __future__ import annotations

import json
from typing import Any

from core.spec import JobSpec

Schema = dict[str, Any]

_REF_PREFIX = "#/$defs/"
_LIMITS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
    ("pattern", "matches `{}`"),
)


def _ref_name(node: Schema) -> str | None:
    ref = node.get("$ref")
    return ref[len(_REF_PREFIX):] if isinstance(ref, str) else None


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _type(node: Schema) -> str:
    """A short, human reading of a property's schema: `int`, `"lora"`, `a` or `b`, a link."""
    name = _ref_name(node)
    if name is not None:
        return f"[{name}](#{name.lower()})"
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "enum" in node:
        return " or ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return " or ".join(_type(option) for option in node[key])
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object":
        values = next(iter(node.get("patternProperties", {}).values()), None)
        if values is None and isinstance(node.get("additionalProperties"), dict):
            values = node["additionalProperties"]
        return f"map of name to {_type(values)}" if values is not None else "object"
    if isinstance(kind, list):
        return " or ".join(kind)
    return {"integer": "int", "number": "number", "string": "string", "boolean": "bool",
            "null": "null"}.get(str(kind), "any")


def _limits(node: Schema) -> str:
    found: list[str] = []
    for option in [node, *node.get("anyOf", [])]:
        found += [fmt.format(option[key]) for key, fmt in _LIMITS if key in option]
    return ", ".join(found)


def _default(name: str, node: Schema, required: list[str]) -> str:
    if name in required:
        return "required"
    if "default" in node:
        return f"`{json.dumps(node['default'])}`"
    # A default_factory has no default in the schema: an empty collection, or a section
    # whose own fields say their defaults.
    empty = {"object": "`{}`", "array": "`[]`"}.get(str(node.get("type")))
    return empty or "its section's defaults"


def _refs_in(node: Any) -> list[str]:
    """Every definition a schema node names, in document order."""
    if isinstance(node, dict):
        found = [n] if (n := _ref_name(node)) else []
        for value in node.values():
            found += _refs_in(value)
        return found
    if isinstance(node, list):
        return [ref for item in node for ref in _refs_in(item)]
    return []


def _sections(schema: Schema) -> list[tuple[str, Schema, list[str]]]:
    """(definition name, its schema, the spec paths that hold it), depth first from the top:
    each section is followed by the sections inside it, as a reader meets them in a spec."""
    defs: dict[str, Schema] = schema.get("$defs", {})
    paths: dict[str, list[str]] = {}
    order: list[str] = []

    def visit(owner_path: str, owner: Schema) -> None:
        for prop, node in owner.get("properties", {}).items():
            path = f"{owner_path}.{prop}" if owner_path else prop
            for ref in _refs_in(node):
                if ref in paths:
                    if path not in paths[ref]:
                        paths[ref].append(path)
                    continue
                paths[ref] = [path]
                order.append(ref)
                visit(path, defs[ref])

    visit("", schema)
    top = ("JobSpec", schema, ["(the whole request body)"])
    return [top] + [(ref, defs[ref], paths[ref]) for ref in order]


def _table(node: Schema) -> str:
    required = node.get("required", [])
    rows = ["| field | type | default | limits | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, prop in node.get("properties", {}).items():
        rows.append(
            f"| `{name}` | {_cell(_type(prop))} | {_cell(_default(name, prop, required))} | "
            f"{_cell(_limits(prop))} | {_cell(prop.get('description', ''))} |"
        )
    return "\n".join(rows)


def reference_markdown() -> str:
    """docs/spec.md, whole."""
    schema = JobSpec.model_json_schema()
    sections = _sections(schema)
    intro = (
        "What this covers: every field of the JobSpec, the body of `POST /v1/jobs` (and what "
        "the OpenAI face translates its requests into), section by section: its type, "
        "default, limits and meaning. Names follow transformers / accelerate / peft.\n\n"
        "Generated from the JobSpec model's JSON Schema (`core/spec/`) by "
        "`python -m core.spec.reference > docs/spec.md`; tests/core/spec/test_reference.py "
        "fails when this file is stale. Do not edit it by hand: change the field's "
        "description and regenerate. The same schema is served as `JobSpec` in the API's "
        "`/openapi.json` (browse it at `/docs`).\n\n"
        "Unknown keys are refused everywhere (a misspelled option gets the closest known "
        "name). Checks that relate several fields (FSDP2 options, ZeRO offload stages, "
        "batch sizes that must divide, ...) are in `core/spec/checks.py`; a spec that breaks "
        "several rules gets one 422 listing every problem with its field path. What the "
        "worker adds to the spec before the trainer reads it (the run plan, spec.json) is "
        "in [jobdir.md](jobdir.md).\n"
    )
    parts = [
        "# The job spec: reference\n",
        intro,
        "## Sections\n",
        "\n".join(
            f"* [{name}](#{name.lower()}): {', '.join(f'`{p}`' for p in paths[:3])}"
            + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            for name, _, paths in sections
        )
        + "\n",
    ]
    for name, node, paths in sections:
        parts.append(f"## {name}\n")
        where = ", ".join(f"`{p}`" for p in paths)
        description = node.get("description", "")
        parts.append(f"At {where}. {description}".rstrip() + "\n")
        parts.append(_table(node) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference_markdown(), end="")
