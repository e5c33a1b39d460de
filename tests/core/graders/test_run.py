"""Grading answers: each grader type, and failures counted per grader, never silent."""

from __future__ import annotations

from typing import Any

import pytest

from core.graders.config import GraderRuntime
from core.graders.run import MIN_CALLS_BEFORE_FAILING, Grading
from core.spec.graders import parse_grader


def grade(grader: dict[str, Any], text: str, item: dict[str, Any] | None = None) -> Any:
    with Grading(parse_grader(grader), GraderRuntime()) as g:
        return g.grade(text, item or {})


def check(op: str, reference: str = "{{item.answer}}") -> dict[str, Any]:
    return {"type": "string_check", "name": "c", "input": "{{sample.output_text}}",
            "reference": reference, "operation": op}


@pytest.mark.parametrize(("op", "text", "want"), [
    ("eq", "Paris", 1.0), ("eq", "paris", 0.0), ("ne", "paris", 1.0),
    ("like", "It is Paris.", 1.0), ("like", "It is paris.", 0.0), ("ilike", "It is PARIS.", 1.0),
])
def test_string_check_operations(op: str, text: str, want: float) -> None:
    assert grade(check(op), text, {"answer": "Paris"}).reward == want


@pytest.mark.parametrize("metric", ["fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2",
                                    "rouge_3", "rouge_4", "rouge_5", "rouge_l"])
def test_similarity_is_one_for_the_reference_and_lower_for_a_near_miss(metric: str) -> None:
    g = {"type": "text_similarity", "name": "s", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "evaluation_metric": metric}
    item = {"answer": "the quick brown fox jumps over the lazy dog"}
    same = grade(g, item["answer"], item).reward
    near = grade(g, "the quick brown fox jumped over a lazy dog", item).reward
    assert same == pytest.approx(1.0)
    assert 0.0 <= near < same


def test_multi_combines_sub_scores_and_reports_each() -> None:
    g = {"type": "multi", "name": "m", "calculate_output": "0.75 * exact + 0.25 * near",
         "graders": {"exact": check("eq"), "near": check("ilike")}}
    s = grade(g, "paris", {"answer": "Paris"})
    assert s.reward == pytest.approx(0.25)
    assert s.sub_scores == {"m.exact": 0.0, "m.near": 1.0, "m": pytest.approx(0.25)}


def test_output_json_and_nested_item_fields_are_templated() -> None:
    g = check("eq", reference="{{item.meta.city}}") | {"input": "{{sample.output_json.city}}"}
    assert grade(g, '{"city": "Oslo"}', {"meta": {"city": "Oslo"}}).reward == 1.0


def test_failures_score_zero_with_their_reason_and_are_counted_per_grader() -> None:
    g = parse_grader({"type": "multi", "name": "m", "calculate_output": "2 * ok + bad",
                      "graders": {"ok": check("eq"), "bad": check("eq", "{{item.other}}")}})
    with Grading(g, GraderRuntime()) as grading:
        s = grading.grade("Paris", {"answer": "Paris"}, row=7)
        assert s.errors == {"m.bad": "{{item.other}}: no field 'other'",
                            "m": "reward 2 is outside [0, 1]"}
        assert s.reward == 0.0
        stats = grading.stats.as_dict()
    assert stats["m.bad"]["errors"] == 1 and stats["m.bad"]["last_error_row"] == 7
    assert stats["m"]["out_of_range"] == 1 and stats["m.ok"]["errors"] == 0


def test_a_grader_failing_more_than_the_threshold_is_named() -> None:
    with Grading(parse_grader(check("eq")), GraderRuntime()) as grading:
        for i in range(MIN_CALLS_BEFORE_FAILING):
            # Every fourth row lacks the field: 25% failed.
            grading.grade("x", {} if i % 4 == 0 else {"answer": "x"}, row=i + 1)
        assert grading.stats.over_threshold(0.3) is None
        over = grading.stats.over_threshold(0.2)
    assert over is not None and over[0] == "c" and over[1].failed == 8
