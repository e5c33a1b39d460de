"""Grader specs in OpenAI's shape (``type`` string_check, text_similarity, python,
score_model, multi, with OpenAI's field names), and their checks.

Field checks live on the models; ``grader_problems`` adds what relates fields (templates
that name a field the sample does not have, a formula that names a grader that is not
there, a metric whose data this server lacks) and what the operator allows, each problem
with its field path. The same models serve ``training.grpo.grader`` of a job, the
``/v1/graders/*`` routes and OpenAI's ``method.reinforcement.grader``.

Importable without torch or the metric libraries (the API validates graders without them).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from core.spec.grader_formula import FormulaError, parse_formula
from core.spec.grader_template import template_problems, template_refs

MAX_TEMPLATE_CHARS = 100_000
MAX_SOURCE_CHARS = 256_000
MAX_SUB_GRADERS = 16
MAX_DEPTH = 3

StringOperation = Literal["eq", "ne", "like", "ilike"]
SimilarityMetric = Literal[
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "cosine",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
]
GraderName = Annotated[str, Field(
    min_length=1, max_length=128,
    description="The grader's name: its score is reported under it (multi: name.key).",
)]
Template = Annotated[str, Field(
    max_length=MAX_TEMPLATE_CHARS,
    description="Text with {{item.field}} (the data row) and {{sample.output_text}} (the answer).",
)]


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelled option must never be silently ignored.
    model_config = ConfigDict(extra="forbid")


class StringCheckGrader(_Strict):
    type: Literal["string_check"] = Field(default="string_check", description="The grader's kind.")
    name: GraderName
    input: Template = Field(description="Text to check, e.g. {{sample.output_text}}.")
    reference: Template = Field(description="Text to compare with, e.g. {{item.answer}}.")
    operation: StringOperation = Field(
        description="eq: equal (1 or 0); ne: not equal; like: reference contained in input; "
        "ilike: the same, ignoring case."
    )


class TextSimilarityGrader(_Strict):
    type: Literal["text_similarity"] = Field(default="text_similarity", description="The grader's kind.")
    name: GraderName
    input: Template
    reference: Template
    evaluation_metric: SimilarityMetric = Field(
        description="fuzzy_match (rapidfuzz ratio), bleu, gleu, meteor (nltk), rouge_1..5, "
        "rouge_l (rouge-score F1); cosine needs an embedding model this server does not "
        "configure."
    )


class PythonGrader(_Strict):
    type: Literal["python"] = Field(default="python", description="The grader's kind.")
    name: GraderName
    source: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="Python source defining grade(sample, item) -> float in [0, 1]; run in a "
        "sandbox (no network, no files but its own, CPU/memory/process limits).",
    )
    image_tag: str | None = Field(
        default=None, description="OpenAI's runtime image; not supported here (leave unset)."
    )


class InputMessage(_Strict):
    role: Literal["user", "assistant", "system", "developer"] = Field(
        description="Who says it, in the judge's chat."
    )
    content: Template
    type: Literal["message"] | None = Field(default=None, description="Always message.")


class SamplingParams(_Strict):
    temperature: float | None = Field(default=None, ge=0, le=2, description="Judge's temperature.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Judge's nucleus sampling.")
    max_completions_tokens: int | None = Field(
        default=None, ge=1, le=32_768, description="Most tokens of the judge's answer."
    )
    seed: int | None = Field(default=None, description="Judge's sampling seed.")
    reasoning_effort: str | None = Field(
        default=None, description="Not supported by the judge endpoint here: leave it unset."
    )


class ScoreModelGrader(_Strict):
    type: Literal["score_model"] = Field(default="score_model", description="The grader's kind.")
    name: GraderName
    model: str = Field(
        min_length=1, max_length=256, description="The judge model, as the judge endpoint names it."
    )
    input: list[InputMessage] = Field(
        min_length=1, max_length=32, description="Chat messages sent to the judge (templated)."
    )
    range: list[float] | None = Field(
        default=None,
        description="[low, high] of the judge's score (default [0, 1]); the reward is the "
        "score rescaled to [0, 1].",
    )
    sampling_params: SamplingParams | None = Field(
        default=None, description="How the judge samples its answer."
    )

    @field_validator("range")
    @classmethod
    def _range(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (len(v) != 2 or not v[0] < v[1]):
            raise ValueError("range must be [low, high] with low < high")
        return v


class MultiGrader(_Strict):
    type: Literal["multi"] = Field(default="multi", description="The grader's kind.")
    name: GraderName
    graders: dict[
        Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")],
        Grader,
    ] = Field(description="Sub-graders by name; the names are calculate_output's variables.")
    calculate_output: str = Field(
        min_length=1,
        max_length=1000,
        description="Arithmetic over the sub-graders' names: + - * / ** parentheses, numbers, "
        "min, max, abs, sqrt, log, exp, floor, ceil, round, clip(x, lo, hi).",
    )

    @field_validator("graders", mode="before")
    @classmethod
    def _one_grader(cls, v: Any) -> Any:
        # The SDK's MultiGrader type holds a single grader (its docs show a dict by name):
        # one grader is its own variable, under its name.
        if isinstance(v, dict) and isinstance(v.get("type"), str) and isinstance(v.get("name"), str):
            return {v["name"]: v}
        return v

    @field_validator("graders")
    @classmethod
    def _count(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            raise ValueError("at least one sub-grader")
        if len(v) > MAX_SUB_GRADERS:
            raise ValueError(f"at most {MAX_SUB_GRADERS} sub-graders")
        return v


def _grader_type(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if isinstance(t, str) else None


Grader = Annotated[
    Annotated[StringCheckGrader, Tag("string_check")]
    | Annotated[TextSimilarityGrader, Tag("text_similarity")]
    | Annotated[PythonGrader, Tag("python")]
    | Annotated[ScoreModelGrader, Tag("score_model")]
    | Annotated[MultiGrader, Tag("multi")],
    Discriminator(
        _grader_type,
        custom_error_type="invalid_grader_type",
        custom_error_message="type must be one of string_check, text_similarity, python, "
        "score_model, multi",
    ),
]
MultiGrader.model_rebuild()


GRADER_TYPES = ("string_check", "text_similarity", "python", "score_model", "multi")


def is_union_tag(loc: tuple[Any, ...], i: int) -> bool:
    """Whether ``loc[i]`` is the grader union's member name that pydantic puts into an
    error's location ("grader.string_check.operation"), which users did not write."""
    if str(loc[i]) not in GRADER_TYPES or i == 0:
        return False
    return loc[i - 1] == "grader" or (i >= 2 and loc[i - 2] == "graders")


class GraderEnvelope(BaseModel):
    """Parses one grader from JSON (the union is not a model of its own)."""

    grader: Grader


def parse_grader(data: Any) -> Grader:
    """A grader from JSON; raises pydantic's ValidationError (locations under 'grader')."""
    return GraderEnvelope.model_validate({"grader": data}).grader


@dataclass(frozen=True)
class GraderProblem:
    param: str  # path below the grader, e.g. "graders.exact.reference"
    message: str


PYTHON_OFF = ("python graders are off on this server (the operator enables them with "
              "FTUNE_PYTHON_GRADERS=true)")


@dataclass(frozen=True)
class GraderCapabilities:
    """What this server can run, from the operator's settings and the installed extras."""

    python: bool = False
    judge: bool = False
    similarity: bool = True
    meteor: bool = False
    # Why python graders are refused, with the fix (GraderRuntime.python_refusal).
    python_refusal: str = PYTHON_OFF


def grader_problems(grader: Grader, can: GraderCapabilities) -> list[GraderProblem]:
    """Every problem of a parsed grader, each with its path below the grader."""
    out: list[GraderProblem] = []
    _walk(grader, "", can, out, depth=1)
    return out


def _walk(
    g: Grader, prefix: str, can: GraderCapabilities, out: list[GraderProblem], depth: int
) -> None:
    def bad(field: str, message: str) -> None:
        out.append(GraderProblem(f"{prefix}{field}", message))

    def template(field: str, text: str) -> None:
        for message in template_problems(text):
            bad(field, message)

    if isinstance(g, (StringCheckGrader, TextSimilarityGrader)):
        template("input", g.input)
        template("reference", g.reference)
    if isinstance(g, TextSimilarityGrader):
        if g.evaluation_metric == "cosine":
            bad("evaluation_metric", "cosine needs an embedding model, which this server "
                "does not configure; use fuzzy_match, bleu, gleu, rouge_* instead")
        elif not can.similarity:
            bad("evaluation_metric", "the text similarity metrics are not installed on this "
                "server (pip extra 'grpo')")
        elif g.evaluation_metric == "meteor" and not can.meteor:
            bad("evaluation_metric", "meteor needs nltk's WordNet data, which this server does "
                "not have (it cannot be downloaded offline); use rouge_l, bleu or gleu")
    elif isinstance(g, PythonGrader):
        if not can.python:
            bad("type", can.python_refusal)
        if g.image_tag is not None:
            bad("image_tag", "runtime images are not supported: the grader runs in this "
                "server's sandbox with the Python standard library; leave it unset")
        problem = source_problem(g.source)
        if problem is not None:
            bad("source", problem)
    elif isinstance(g, ScoreModelGrader):
        if not can.judge:
            bad("type", "score_model graders need a judge endpoint, which this server does "
                "not configure (FTUNE_GRADER_JUDGE_URL)")
        for i, m in enumerate(g.input):
            template(f"input[{i}].content", m.content)
        sp = g.sampling_params
        if sp is not None and sp.reasoning_effort is not None:
            bad("sampling_params.reasoning_effort", "not supported by the judge endpoint here: "
                "leave it unset")
    elif isinstance(g, MultiGrader):
        if depth >= MAX_DEPTH:
            bad("graders", f"multi graders nest at most {MAX_DEPTH} deep")
            return
        try:
            names = parse_formula(g.calculate_output).names
        except FormulaError as e:
            bad("calculate_output", str(e))
        else:
            unknown = sorted(names - set(g.graders))
            if unknown:
                bad("calculate_output", f"names no sub-grader: {', '.join(unknown)} (the "
                    f"sub-graders are {', '.join(sorted(g.graders))})")
        for key, sub in g.graders.items():
            _walk(sub, f"{prefix}graders.{key}.", can, out, depth + 1)


def item_fields(grader: Grader) -> set[str]:
    """Top-level ``item`` fields the grader's templates reference ({{item.answer.text}}
    needs ``answer``). Python graders get the whole item and reference none by template."""
    return {ref[0] for ref in _refs(grader) if ref and ref[0] != ""}


def _refs(g: Grader) -> list[tuple[str, ...]]:
    texts: list[str] = []
    if isinstance(g, (StringCheckGrader, TextSimilarityGrader)):
        texts = [g.input, g.reference]
    elif isinstance(g, ScoreModelGrader):
        texts = [m.content for m in g.input]
    out = [ref[1:] for t in texts for ref in template_refs(t) if ref[0] == "item"]
    if isinstance(g, MultiGrader):
        for sub in g.graders.values():
            out.extend(_refs(sub))
    return out


def leaf_names(grader: Grader, prefix: str = "") -> list[str]:
    """The names every score is reported under: the grader's own name, and for a multi
    grader each sub-grader's key path (``name.key``)."""
    own = prefix + grader.name if not prefix else prefix.rstrip(".")
    out = [own]
    if isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            out.extend(leaf_names(sub, f"{own}.{key}."))
    return out


def source_problem(source: str) -> str | None:
    """Compile (never run) the source: a syntax error or a missing grade(sample, item)."""
    try:
        tree = ast.parse(source, filename="grader.py")
    except SyntaxError as e:
        return f"line {e.lineno}: {e.msg}"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "grade":
            if isinstance(node, ast.AsyncFunctionDef):
                return "grade must be a plain function, not async"
            if len(node.args.args) + len(node.args.posonlyargs) < 2 and node.args.vararg is None:
                return "grade must take (sample, item)"
            return None
    return "defines no top-level grade(sample, item) function"
