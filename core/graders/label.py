"""label_model graders (OpenAI's LabelModelGrader): a judge model classifies the answer into
one of ``labels``; the item passes when that label is one of ``passing_labels``.

The judge is the score_model graders' (FTUNE_GRADER_JUDGE_URL, core/graders/judge.py). OpenAI
asks its judge for structured output; an OpenAI-compatible endpoint may not have it, so the
label is read from the answer's text: the whole answer (case and surrounding punctuation
aside), a JSON object's ``label``, or the one label the answer names as a word. An answer
that names no label, or several, is the grader's error (the item counts as errored)."""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.graders.judge import Judge, JudgeError
from core.spec.grader_template import render, template_problems
from core.spec.graders import GraderName, GraderProblem, InputMessage, SamplingParams, _Strict

MAX_LABELS = 64
GREEDY = SamplingParams(temperature=0.0)


class LabelModelGrader(_Strict):
    type: Literal["label_model"] = Field(default="label_model", description="The grader's kind.")
    name: GraderName
    model: str = Field(
        min_length=1, max_length=256, description="The judge model, as the judge endpoint names it."
    )
    input: list[InputMessage] = Field(
        min_length=1, max_length=32,
        description="Chat messages sent to the judge ({{item.*}}, {{sample.output_text}}).",
    )
    labels: list[str] = Field(
        min_length=1, max_length=MAX_LABELS, description="The labels the judge chooses from."
    )
    passing_labels: list[str] = Field(
        min_length=1, max_length=MAX_LABELS, description="The labels that pass (a subset)."
    )

    @field_validator("labels")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len({x.casefold() for x in v}) != len(v):
            raise ValueError("labels must be distinct (ignoring case)")
        if any(not x.strip() or len(x) > 256 for x in v):
            raise ValueError("each label is 1 to 256 characters of text")
        return v

    @model_validator(mode="after")
    def _subset(self) -> LabelModelGrader:
        unknown = [x for x in self.passing_labels if x not in self.labels]
        if unknown:
            raise ValueError(f"passing_labels {unknown} are not among labels {self.labels}")
        return self


def label_problems(g: LabelModelGrader, judge_configured: bool) -> list[GraderProblem]:
    out: list[GraderProblem] = []
    if not judge_configured:
        out.append(GraderProblem("type", "label_model graders need a judge endpoint, which "
                                 "this server does not configure (FTUNE_GRADER_JUDGE_URL)"))
    for i, m in enumerate(g.input):
        for message in template_problems(m.content):
            out.append(GraderProblem(f"input[{i}].content", message))
    return out


def label_of(content: str, labels: list[str]) -> str:
    """The label the judge's answer names; JudgeError if none or several."""
    text = content.strip()
    by_fold = {x.casefold(): x for x in labels}
    bare = text.strip(" \t\n\"'`.!").casefold()
    if bare in by_fold:
        return by_fold[bare]
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("label"), str):
        found = by_fold.get(obj["label"].strip().casefold())
        if found is not None:
            return found
    named = [x for x in labels
             if re.search(rf"(?<!\w){re.escape(x.casefold())}(?!\w)", text.casefold())]
    if len(named) == 1:
        return named[0]
    what = "several labels" if named else "no label"
    raise JudgeError(f"the judge's answer names {what} of {labels}: {text[:200]!r}")


def classify(judge: Judge, g: LabelModelGrader, sample: dict[str, object],
             item: dict[str, object]) -> str:
    """The judge's label for one sample (templates rendered as the other graders do)."""
    messages = [{"role": m.role, "content": render(m.content, sample, item)} for m in g.input]
    # Greedy: a classification wants the judge's most likely label, not a sample of them
    # (OpenAI's label_model has no sampling parameters to ask otherwise).
    return label_of(judge.complete(g.model, messages, GREEDY), g.labels)
