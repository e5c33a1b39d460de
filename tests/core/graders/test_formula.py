"""calculate_output: arithmetic only, parsed against a whitelist, never eval'd."""

from __future__ import annotations

import pytest

from core.spec.grader_formula import FormulaError, parse_formula


def test_arithmetic_over_sub_grader_names() -> None:
    f = parse_formula("0.5 * exact + max(sim, 0.2) ** 2 - clip(-a, 0, 1)")
    assert f.names == {"exact", "sim", "a"}
    assert f.evaluate({"exact": 1.0, "sim": 0.5, "a": -0.25}) == pytest.approx(0.5 + 0.25 - 0.25)


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')",
    "exact.__class__",
    "[x for x in (1, 2)]",
    "exact if sim else 0",
    "lambda: 1",
    "open('/etc/passwd')",
    "'text'",
    "a[0]",
    "exact == 1",
])
def test_anything_but_arithmetic_is_refused(text: str) -> None:
    with pytest.raises(FormulaError):
        parse_formula(text)


def test_a_huge_exponent_is_refused_before_it_is_computed() -> None:
    with pytest.raises(FormulaError, match="exponent"):
        parse_formula("a ** 1000000").evaluate({"a": 9.0})


def test_a_math_error_is_a_formula_error() -> None:
    with pytest.raises(FormulaError, match="division by zero"):
        parse_formula("a / b").evaluate({"a": 1.0, "b": 0.0})
