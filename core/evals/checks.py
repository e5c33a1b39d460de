"""What an eval or a run is refused for before anything runs, each problem with its field
path: an item schema that is not a JSON Schema of an object, criteria with the same name, a
grader this server cannot run, a template or grader that references an item field the schema
lacks, rows that do not match the schema (with their row numbers), a jsonl row without a
sample to grade."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from core.evals.spec import (
    MAX_SCHEMA_BYTES,
    CompletionsDataSource,
    Criterion,
    CustomDataSourceConfig,
    ItemReferenceInput,
    TemplateInput,
)
from core.graders.label import LabelModelGrader, label_problems
from core.spec import Problem
from core.spec.grader_template import template_problems, template_refs
from core.spec.graders import (
    Grader,
    GraderCapabilities,
    MultiGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    grader_problems,
)

# Row problems reported at most (a file with every row wrong names the first ones).
MAX_ROW_PROBLEMS = 20


def schema_problems(config: CustomDataSourceConfig) -> list[Problem]:
    param = "data_source_config.item_schema"
    schema = config.item_schema
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        return [Problem(param, f"larger than {MAX_SCHEMA_BYTES} bytes as JSON")]
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = ".".join(str(p) for p in e.absolute_path)
        return [Problem(f"{param}.{where}" if where else param,
                        f"not a valid JSON Schema: {e.message}")]
    if schema.get("type") != "object":
        return [Problem(f"{param}.type", "an item is an object: the schema's type must be "
                        "\"object\"")]
    return []


def missing_field(schema: dict[str, Any], path: tuple[str, ...]) -> str | None:
    """Why the item schema has no field at ``path`` (e.g. ("answer",)), or None if it has
    it. Where a (sub)schema declares ``properties``, the field must be among them; a schema
    that declares none says nothing about its fields and is taken at its word."""
    node: Any = schema
    for depth, part in enumerate(path):
        props = node.get("properties") if isinstance(node, dict) else None
        if not isinstance(props, dict):
            return None
        if part not in props:
            where = "item." + ".".join(path[:depth]) if depth else "the item schema"
            known = ", ".join(sorted(props)) or "none"
            return (f"{where} has no field {part!r} (its properties: {known})")
        node = props[part]
    return None


def _criterion_texts(c: Criterion | Grader) -> list[tuple[str, str]]:
    """(field path below the criterion, template text) of every template it holds."""
    if isinstance(c, (StringCheckGrader, TextSimilarityGrader)):
        return [("input", c.input), ("reference", c.reference)]
    if isinstance(c, (ScoreModelGrader, LabelModelGrader)):
        return [(f"input[{i}].content", m.content) for i, m in enumerate(c.input)]
    if isinstance(c, MultiGrader):
        return [(f"graders.{k}.{p}", t) for k, sub in c.graders.items()
                for p, t in _criterion_texts(sub)]
    return []


def criteria_problems(criteria: list[Criterion], config: CustomDataSourceConfig,
                      can: GraderCapabilities) -> list[Problem]:
    out: list[Problem] = []
    seen: set[str] = set()
    for i, c in enumerate(criteria):
        param = f"testing_criteria[{i}]"
        if c.name in seen:
            out.append(Problem(f"{param}.name", f"{c.name!r} names another criterion too: "
                               "results are reported by name"))
        seen.add(c.name)
        if isinstance(c, LabelModelGrader):
            found = label_problems(c, can.judge)
        else:
            found = grader_problems(c, can)
        out.extend(Problem(f"{param}.{p.param}", p.message) for p in found)
        for field, text in _criterion_texts(c):
            for ref in template_refs(text):
                if ref[0] == "item" and len(ref) > 1 and (why := missing_field(
                        config.item_schema, ref[1:])) is not None:
                    out.append(Problem(f"{param}.{field}", f"{{{{{'.'.join(ref)}}}}}: {why}"))
                elif ref[0] == "sample" and not config.include_sample_schema:
                    out.append(Problem(f"{param}.{field}", f"{{{{{'.'.join(ref)}}}}}: the eval "
                                       "has no sample (set data_source_config."
                                       "include_sample_schema to true)"))
    return out


def criterion_item_fields(criteria: list[Criterion]) -> list[tuple[str, tuple[str, ...]]]:
    """(criterion name, item field path) of every ``{{item.*}}`` a criterion reads."""
    return [(c.name, ref[1:]) for c in criteria for _, text in _criterion_texts(c)
            for ref in template_refs(text) if ref[0] == "item" and len(ref) > 1]


def lacking_field(item: Any, path: tuple[str, ...]) -> bool:
    node: Any = item
    for part in path:
        if not isinstance(node, dict) or node.get(part) is None:
            return True
        node = node[part]
    return False


def input_problems(ds: CompletionsDataSource, schema: dict[str, Any]) -> list[Problem]:
    """The completions source's messages against the item schema, and the sampling
    parameters that have no meaning here."""
    out: list[Problem] = []
    im = ds.input_messages
    if isinstance(im, TemplateInput):
        for i, m in enumerate(im.template):
            param = f"data_source.input_messages.template[{i}].content"
            for message in template_problems(m.content):
                out.append(Problem(param, message))
            for ref in template_refs(m.content):
                if ref[0] == "sample":
                    out.append(Problem(param, f"{{{{{'.'.join(ref)}}}}}: the model's input can "
                                       "only use the item ({{item.*}}); the sample is its answer"))
                elif len(ref) > 1 and (why := missing_field(schema, ref[1:])) is not None:
                    out.append(Problem(param, f"{{{{{'.'.join(ref)}}}}}: {why}"))
    elif isinstance(im, ItemReferenceInput):
        path = tuple(im.item_reference.split(".")[1:])
        if (why := missing_field(schema, path)) is not None:
            out.append(Problem("data_source.input_messages.item_reference", why))
    sp = ds.sampling_params
    if sp is not None:
        for name in ("reasoning_effort", "response_format", "tools"):
            if getattr(sp, name) is not None:
                out.append(Problem(f"data_source.sampling_params.{name}", "not supported by "
                                   "the models served here: leave it unset"))
    return out


def row_problems(rows: Iterable[tuple[int, dict[str, Any]]], schema: dict[str, Any],
                 *, needs_sample: bool, item_reference: str | None) -> list[tuple[int, str]]:
    """(row number, message) for rows that do not match: ``rows`` are (number, row) with
    row = {"item": {...}, "sample": {...}?} as a run reads them."""
    validator = Draft202012Validator(schema)
    out: list[tuple[int, str]] = []
    for n, row in rows:
        item = row.get("item")
        if not isinstance(item, dict):
            out.append((n, "needs an \"item\" object (rows are {\"item\": {...}})"))
        else:
            for err in sorted(validator.iter_errors(item), key=lambda e: list(e.path))[:3]:
                where = "item" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}"
                                         for p in err.absolute_path)
                out.append((n, f"{where}: {err.message}"))
            if item_reference is not None:
                out.extend((n, m) for m in _messages_problems(item, item_reference))
        if needs_sample:
            sample = row.get("sample")
            if not isinstance(sample, dict) or not isinstance(sample.get("output_text"), str):
                out.append((n, ("a jsonl run grades the given samples: the row needs "
                            "\"sample\": {\"output_text\": \"...\"}")))
        if len(out) >= MAX_ROW_PROBLEMS:
            break
    return out[:MAX_ROW_PROBLEMS]


def _messages_problems(item: dict[str, Any], reference: str) -> list[str]:
    value: Any = item
    for part in reference.split(".")[1:]:
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return [f"{reference}: must be a non-empty list of chat messages"]
    for i, m in enumerate(value):
        if (not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                             "assistant")
                or not isinstance(m.get("content"), str)):
            return [f"{reference}[{i}]: a message needs a role and text content"]
    return []
