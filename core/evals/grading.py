"""An eval's testing criteria over one sample: each criterion scored with ftune's graders
(core/graders/run.py; python graders in their sandbox), passed against its threshold, and
the item's status: error if any criterion errored on it (its message on the result), else
pass if every criterion passed, else fail."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Self

from core.evals.spec import Criterion, pass_threshold
from core.graders.config import GraderRuntime
from core.graders.judge import Judge, JudgeError
from core.graders.label import LabelModelGrader, classify
from core.graders.run import Grading
from core.spec.grader_template import TemplateError, sample_of


@dataclass
class ItemGrade:
    status: str  # pass | fail | error
    results: list[dict[str, Any]]
    seconds: float


def item_status(results: list[dict[str, Any]]) -> str:
    if any(r.get("error") for r in results):
        return "error"
    return "pass" if all(r["passed"] for r in results) else "fail"


class CriteriaGrading:
    """Holds a grader per criterion (sandboxes, the judge's client) for a whole run."""

    def __init__(self, criteria: list[Criterion], runtime: GraderRuntime) -> None:
        self.criteria = criteria
        self.runtime = runtime
        self._gradings: dict[int, Grading] = {}
        self._judge: Judge | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for g in self._gradings.values():
            g.close()
        self._gradings.clear()
        if self._judge is not None:
            self._judge.close()
            self._judge = None

    def grade(self, output_text: str, item: dict[str, Any]) -> ItemGrade:
        t0 = time.perf_counter()
        results = [self._one(i, c, output_text, item) for i, c in enumerate(self.criteria)]
        return ItemGrade(item_status(results), results, time.perf_counter() - t0)

    def _one(self, i: int, c: Criterion, output_text: str,
             item: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"name": c.name, "type": c.type, "sample": None}
        if isinstance(c, LabelModelGrader):
            try:
                label = classify(self._judge_client(), c, sample_of(output_text), item)
            except (JudgeError, TemplateError) as e:
                return {**out, "score": 0.0, "passed": False, "error": str(e)}
            passed = label in c.passing_labels
            return {**out, "score": 1.0 if passed else 0.0, "passed": passed, "label": label}
        grading = self._gradings.get(i)
        if grading is None:
            grading = self._gradings[i] = Grading(c, self.runtime)
        score = grading.grade(output_text, item)
        out["score"] = score.reward
        if score.errors:
            # The criterion's own error first, then its sub-graders' (multi).
            first = score.errors.get(c.name) or next(iter(score.errors.values()))
            return {**out, "passed": False, "error": first,
                    **({"errors": score.errors} if len(score.errors) > 1 else {})}
        out["passed"] = score.reward >= pass_threshold(c)
        if len(score.sub_scores) > 1:
            out["sub_scores"] = score.sub_scores
        return out

    def _judge_client(self) -> Judge:
        if self._judge is None:
            if self.runtime.judge_url is None:
                raise JudgeError("no judge endpoint is configured on this server")
            self._judge = Judge(self.runtime.judge_url, self.runtime.judge_policy(),
                                self.runtime.judge_api_key(), self.runtime.judge_timeout_seconds)
        return self._judge
