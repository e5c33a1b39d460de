"""``calculate_output`` of a multi grader: arithmetic over sub-grader scores, parsed with
``ast`` against a whitelist of node types and functions, then evaluated by walking the
tree. Never ``eval``: no attribute access, subscripts, calls other than the listed
functions, comprehensions or names other than the sub-graders'. Sizes are bounded (text
length, tree size, exponent) so a formula cannot make the worker spin."""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass

MAX_NODES = 200
MAX_EXPONENT = 64.0


class FormulaError(ValueError):
    """The formula is not one we evaluate; the message says what."""


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


FUNCTIONS: dict[str, tuple[Callable[..., float], tuple[int, int]]] = {
    # name: (function, (min args, max args))
    "min": (min, (1, 32)),
    "max": (max, (1, 32)),
    "abs": (abs, (1, 1)),
    "sqrt": (math.sqrt, (1, 1)),
    "log": (math.log, (1, 1)),
    "exp": (math.exp, (1, 1)),
    "floor": (math.floor, (1, 1)),
    "ceil": (math.ceil, (1, 1)),
    "round": (round, (1, 2)),
    "clip": (_clip, (3, 3)),
}
_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


@dataclass(frozen=True)
class Formula:
    tree: ast.expr
    names: frozenset[str]

    def evaluate(self, values: dict[str, float]) -> float:
        """The formula's value; FormulaError on a math error (division by zero, log of 0)."""
        try:
            result = float(_eval(self.tree, values))
        except (ZeroDivisionError, ValueError, OverflowError) as e:
            raise FormulaError(f"calculate_output failed: {e}") from None
        if not math.isfinite(result):
            raise FormulaError("calculate_output is not a finite number")
        return result


def parse_formula(text: str) -> Formula:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise FormulaError(f"not an arithmetic expression ({e.msg})") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise FormulaError(f"longer than {MAX_NODES} terms")
    names: set[str] = set()
    for node in nodes:
        _check(node, names)
    return Formula(tree.body, frozenset(names))


def _check(node: ast.AST, names: set[str]) -> None:
    if isinstance(node, (ast.Expression, ast.Load, ast.UAdd, ast.USub, ast.Pow)):
        return
    if isinstance(node, ast.operator) and type(node) in _BINARY:
        return
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise FormulaError(f"only numbers are allowed, not {node.value!r}")
        return
    if isinstance(node, ast.Call):
        fn = node.func
        if not isinstance(fn, ast.Name) or fn.id not in FUNCTIONS:
            allowed = ", ".join(FUNCTIONS)
            raise FormulaError(f"calls only {allowed}")
        if node.keywords:
            raise FormulaError(f"{fn.id}() takes no keyword arguments")
        lo, hi = FUNCTIONS[fn.id][1]
        if not lo <= len(node.args) <= hi:
            raise FormulaError(f"{fn.id}() takes {lo}..{hi} arguments, not {len(node.args)}")
        return
    if isinstance(node, ast.Name):
        if node.id not in FUNCTIONS:
            names.add(node.id)
        return
    raise FormulaError(
        f"{type(node).__name__} is not allowed: only numbers, sub-grader names, + - * / **, "
        "parentheses and the listed functions"
    )


def _eval(node: ast.expr, values: dict[str, float]) -> float:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, (int, float))  # parse_formula admitted numbers only
        return float(node.value)
    if isinstance(node, ast.Name):
        if node.id not in values:
            raise FormulaError(f"no score for {node.id!r}")
        return float(values[node.id])
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, values)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, values), _eval(node.right, values)
        if isinstance(node.op, ast.Pow):
            if abs(b) > MAX_EXPONENT:
                raise FormulaError(f"exponent {b} is above {MAX_EXPONENT}")
            return float(a**b)
        return _BINARY[type(node.op)](a, b)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        fn = FUNCTIONS[node.func.id][0]
        return float(fn(*(_eval(a, values) for a in node.args)))
    raise FormulaError(f"{type(node).__name__} is not allowed")
