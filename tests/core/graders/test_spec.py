"""Grader specs in OpenAI's shape: parsed, and every problem named by its field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from core.spec.graders import (
    GraderCapabilities,
    MultiGrader,
    grader_problems,
    item_fields,
    parse_grader,
)

ALL = GraderCapabilities(python=True, judge=True, similarity=True, meteor=True)


def check(name: str, **fields: Any) -> dict[str, Any]:
    return {"type": "string_check", "name": name, "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}", "operation": "eq", **fields}


def problems(data: dict[str, Any], can: GraderCapabilities = ALL) -> dict[str, str]:
    return {p.param: p.message for p in grader_problems(parse_grader(data), can)}


def test_an_unknown_type_names_the_types() -> None:
    with pytest.raises(ValidationError, match="string_check, text_similarity, python"):
        parse_grader({"type": "label_model", "name": "x"})


def test_an_unknown_field_is_refused_not_ignored() -> None:
    with pytest.raises(ValidationError, match="operaton"):
        parse_grader({**check("x"), "operaton": "eq"})


def test_multi_names_each_problem_by_its_path() -> None:
    found = problems({
        "type": "multi", "name": "m", "calculate_output": "exact + missing",
        "graders": {
            "exact": check("e", reference="{{item.answer"),
            "sim": {"type": "text_similarity", "name": "s", "input": "{{sample.output}}",
                    "reference": "x", "evaluation_metric": "cosine"},
        },
    })
    assert "names no sub-grader: missing" in found["calculate_output"]
    assert "unbalanced" in found["graders.exact.reference"]
    assert "a sample has output_text" in found["graders.sim.input"]
    assert "embedding model" in found["graders.sim.evaluation_metric"]


def test_what_the_server_lacks_is_said_at_validation() -> None:
    none = GraderCapabilities(python=False, judge=False, similarity=True, meteor=False)
    assert "FTUNE_PYTHON_GRADERS" in problems(
        {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0\n"}, none
    )["type"]
    assert "FTUNE_GRADER_JUDGE_URL" in problems(
        {"type": "score_model", "name": "j", "model": "m",
         "input": [{"role": "user", "content": "{{sample.output_text}}"}]}, none
    )["type"]
    assert "WordNet" in problems(
        {"type": "text_similarity", "name": "s", "input": "a", "reference": "b",
         "evaluation_metric": "meteor"}, none
    )["evaluation_metric"]


def test_python_source_is_compiled_not_run() -> None:
    found = problems({"type": "python", "name": "p", "source": "def grade(s):\n  return 1\n"})
    assert "grade must take (sample, item)" in found["source"]
    found = problems({"type": "python", "name": "p", "source": "def grade(s, i)\n"})
    assert "line 1" in found["source"]


def test_item_fields_are_collected_through_multi() -> None:
    g = parse_grader({
        "type": "multi", "name": "m", "calculate_output": "a",
        "graders": {"a": check("a", reference="{{item.answer.text}} {{ item.lang }}")},
    })
    assert item_fields(g) == {"answer", "lang"}


def test_the_sdks_single_sub_grader_form_is_its_own_variable() -> None:
    g = parse_grader({"type": "multi", "name": "m", "calculate_output": "exact * 2",
                      "graders": check("exact")})
    assert isinstance(g, MultiGrader) and list(g.graders) == ["exact"]
    assert problems(g.model_dump()) == {}
