"""Grading one model answer: the grader tree walked, every leaf scored, failures kept.

A leaf that raises (a template naming a missing field, a sandbox limit, a judge that did
not answer) scores 0 with its error; a score outside [0, 1] also scores 0, counted as out of
range. Nothing is silently turned into a zero: every such call is counted per grader in
``GraderStats``, which the trainer reports (events, metrics) and checks against the
operator's threshold (``grader_failed``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Self

from core.graders.config import GraderRuntime
from core.graders.judge import Judge, JudgeError
from core.graders.sandbox import PythonSandbox
from core.graders.text import similarity, string_check
from core.spec.grader_formula import FormulaError, parse_formula
from core.spec.grader_template import TemplateError, render, sample_of
from core.spec.graders import (
    Grader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)

MIN_CALLS_BEFORE_FAILING = 32


@dataclass
class Score:
    """One answer's reward, each leaf's score by name, and the errors by grader name."""

    reward: float
    sub_scores: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class GraderCount:
    calls: int = 0
    errors: int = 0
    out_of_range: int = 0
    seconds: float = 0.0
    last_error: str | None = None
    last_error_row: int | None = None

    @property
    def failed(self) -> int:
        return self.errors + self.out_of_range


@dataclass
class GraderStats:
    """Calls, errors and out-of-range rewards per grader name, since the start."""

    by_name: dict[str, GraderCount] = field(default_factory=dict)

    def record(self, name: str, seconds: float, error: str | None, out_of_range: bool,
               row: int | None) -> None:
        c = self.by_name.setdefault(name, GraderCount())
        c.calls += 1
        c.seconds += seconds
        if error is not None:
            if out_of_range:
                c.out_of_range += 1
            else:
                c.errors += 1
            c.last_error, c.last_error_row = error, row

    def over_threshold(self, max_ratio: float) -> tuple[str, GraderCount] | None:
        """The first grader whose failed share exceeds ``max_ratio`` (after enough calls)."""
        for name, c in self.by_name.items():
            if c.calls >= MIN_CALLS_BEFORE_FAILING and c.failed > max_ratio * c.calls:
                return name, c
        return None

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, Any]]) -> GraderStats:
        """The inverse of ``as_dict`` (the counts the grading process sends back)."""
        return cls({name: GraderCount(int(c["calls"]), int(c["errors"]), int(c["out_of_range"]),
                                      float(c["seconds"]), c.get("last_error"),
                                      c.get("last_error_row"))
                    for name, c in d.items()})

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {
            name: {"calls": c.calls, "errors": c.errors, "out_of_range": c.out_of_range,
                   "seconds": round(c.seconds, 4), "last_error": c.last_error,
                   "last_error_row": c.last_error_row}
            for name, c in self.by_name.items()
        }


class Grading:
    """Scores answers with one grader. Holds the sandboxes of its python graders and the
    judge's client: call ``close`` (or use ``with``)."""

    def __init__(self, grader: Grader, runtime: GraderRuntime) -> None:
        self.grader = grader
        self.runtime = runtime
        self.stats = GraderStats()
        self._sandboxes: dict[str, PythonSandbox] = {}
        self._judge: Judge | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for sb in self._sandboxes.values():
            sb.close()
        self._sandboxes.clear()
        if self._judge is not None:
            self._judge.close()
            self._judge = None

    def grade_batch(self, answers: list[tuple[str, dict[str, Any], int | None]]) -> list[Score]:
        return [self.grade(text, item, row) for text, item, row in answers]

    def grade(self, output_text: str, item: dict[str, Any], row: int | None = None) -> Score:
        score = Score(0.0)
        sample = sample_of(output_text)
        score.reward = self._node(self.grader, self.grader.name, sample, item, row, score)
        return score

    def _node(self, g: Grader, name: str, sample: dict[str, Any], item: dict[str, Any],
              row: int | None, out: Score) -> float:
        t0 = time.perf_counter()
        error: str | None = None
        out_of_range = False
        value = 0.0
        try:
            value = self._value(g, name, sample, item, row, out)
        except (TemplateError, JudgeError, FormulaError, GraderCallError) as e:
            error = str(e)
        except (ArithmeticError, LookupError, OSError, RuntimeError, TypeError, ValueError) as e:
            # A metric library's failure on odd text is the grader's, not the run's.
            error = f"{type(e).__name__}: {e}"
        if error is None and not 0.0 <= value <= 1.0:
            error, out_of_range = f"reward {value:.6g} is outside [0, 1]", True
        if error is not None:
            value = 0.0
            out.errors[name] = error
        out.sub_scores[name] = value
        self.stats.record(name, time.perf_counter() - t0, error, out_of_range, row)
        return value

    def _value(self, g: Grader, name: str, sample: dict[str, Any], item: dict[str, Any],
               row: int | None, out: Score) -> float:
        if isinstance(g, StringCheckGrader):
            return string_check(g.operation, render(g.input, sample, item),
                                render(g.reference, sample, item))
        if isinstance(g, TextSimilarityGrader):
            return similarity(g.evaluation_metric, render(g.input, sample, item),
                              render(g.reference, sample, item))
        if isinstance(g, PythonGrader):
            refusal = self.runtime.python_refusal()
            if refusal is not None:
                raise GraderCallError(refusal)
            sb = self._sandboxes.get(name)
            if sb is None:
                sb = self._sandboxes[name] = PythonSandbox(g.source, self.runtime.sandbox_limits())
            result = sb.call(sample, item)
            if result.error is not None or result.score is None:
                raise GraderCallError(result.error or "no score")
            return result.score
        if isinstance(g, ScoreModelGrader):
            messages = [{"role": m.role, "content": render(m.content, sample, item)}
                        for m in g.input]
            return self._judge_client().score(g, messages)
        assert isinstance(g, MultiGrader)
        values = {key: self._node(sub, f"{name}.{key}", sample, item, row, out)
                  for key, sub in g.graders.items()}
        return parse_formula(g.calculate_output).evaluate(values)

    def _judge_client(self) -> Judge:
        if self._judge is None:
            if self.runtime.judge_url is None:
                raise GraderCallError("no judge endpoint is configured on this server")
            self._judge = Judge(self.runtime.judge_url, self.runtime.judge_policy(),
                                self.runtime.judge_api_key(), self.runtime.judge_timeout_seconds)
        return self._judge


class GraderCallError(RuntimeError):
    """A grader call failed (sandbox limit, grader exception, no judge)."""
