"""Try a grader before paying for a run: validate it, or grade one sample against one item,
with the same code a GRPO job uses (core/graders/). Python graders run in their sandbox
(separate processes), never in the API process."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from core.graders.config import GraderRuntime
from core.graders.run import Grading, Score
from core.infra.errors import InvalidRequest
from core.infra.settings import Settings
from core.spec.graders import Grader, grader_problems, is_union_tag, parse_grader

MAX_SAMPLE_CHARS = 200_000
MAX_ITEM_BYTES = 1 << 20


def _param(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for i, p in enumerate(loc) if not is_union_tag(loc, i))


def checked_grader(data: Any, settings: Settings) -> Grader:
    """The parsed grader, or one error listing every problem with its field path (a 422; on
    OpenAI's paths the error renderer answers it as OpenAI does, a 400)."""
    details: list[dict[str, str]] = []
    grader: Grader | None = None
    try:
        grader = parse_grader(data)
    except ValidationError as e:
        details = [{"param": _param(tuple(err["loc"])), "message": err["msg"]}
                   for err in e.errors()]
    if grader is not None:
        can = GraderRuntime.from_settings(settings).capabilities()
        details = [{"param": f"grader.{p.param}", "message": p.message}
                   for p in grader_problems(grader, can)]
    if details:
        n = len(details)
        message = (f"{details[0]['param']}: {details[0]['message']}" if n == 1
                   else f"the grader has {n} problems")
        raise InvalidRequest(message, param=details[0]["param"] if n == 1 else None,
                             code="invalid_grader", details=details)
    assert grader is not None
    return grader


def check_inputs(model_sample: str, item: Any) -> dict[str, Any]:
    if len(model_sample) > MAX_SAMPLE_CHARS:
        raise InvalidRequest(f"longer than {MAX_SAMPLE_CHARS} characters", param="model_sample")
    if item is None:
        item = {}
    if not isinstance(item, dict):
        raise InvalidRequest("must be an object (the dataset row)", param="item")
    if len(json.dumps(item)) > MAX_ITEM_BYTES:
        raise InvalidRequest(f"larger than {MAX_ITEM_BYTES} bytes as JSON", param="item")
    return item


@dataclass
class RunResult:
    grader: Grader
    score: Score
    seconds: float


def run_grader(grader: Grader, model_sample: str, item: dict[str, Any],
               settings: Settings) -> RunResult:
    """Grade one sample (blocking: call from a worker thread)."""
    import time

    t0 = time.perf_counter()
    with Grading(grader, GraderRuntime.from_settings(settings)) as grading:
        score = grading.grade(model_sample, item)
    return RunResult(grader, score, time.perf_counter() - t0)


def openai_run_response(r: RunResult) -> dict[str, Any]:
    """OpenAI's GraderRunResponse: reward, sub_rewards, and metadata with its error flags."""
    g, s = r.grader, r.score
    errors = list(s.errors.values())
    python_error = next((m for n, m in s.errors.items() if _kind(g, n) == "python"), None)
    judge_error = next((m for n, m in s.errors.items() if _kind(g, n) == "score_model"), None)
    return {
        "reward": s.reward,
        "sub_rewards": {n: v for n, v in s.sub_scores.items() if n != g.name},
        "model_grader_token_usage_per_model": {},
        "metadata": {
            "name": g.name,
            "type": g.type,
            "execution_time": r.seconds,
            "sampled_model_name": None,
            "scores": dict(s.sub_scores),
            "token_usage": None,
            "errors": {
                "formula_parse_error": any("calculate_output" in m for m in errors),
                "invalid_variable_error": any("no field" in m for m in errors),
                "model_grader_parse_error": judge_error is not None and "no score" in judge_error,
                "model_grader_refusal_error": False,
                "model_grader_server_error": judge_error is not None
                and "no score" not in judge_error,
                "model_grader_server_error_details": judge_error,
                "other_error": any(_kind(g, n) in ("string_check", "text_similarity")
                                   for n in s.errors),
                "python_grader_runtime_error": python_error is not None,
                "python_grader_runtime_error_details": python_error,
                "python_grader_server_error": False,
                "python_grader_server_error_type": None,
                "sample_parse_error": False,
                "truncated_observation_error": False,
                "unresponsive_reward_error": python_error is not None
                and "wall-clock" in python_error,
            },
        },
    }


def _kind(g: Grader, name: str) -> str | None:
    """The type of the grader reported under ``name`` (``multi.key.key`` paths)."""
    from core.spec.graders import MultiGrader

    parts = name.split(".")[1:]
    node: Grader = g
    for key in parts:
        if not isinstance(node, MultiGrader) or key not in node.graders:
            return None
        node = node.graders[key]
    return node.type
