"""/v1/graders: check a grader, or grade one sample, before paying for a GRPO run; also at
OpenAI's paths (/v1/fine_tuning/alpha/graders/*, the official SDK's
client.fine_tuning.alpha.graders.run/validate) in OpenAI's shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant, SettingsDep
from api.errors import error_responses
from api.services import graders

router = APIRouter(tags=["graders"], responses=error_responses(401))


class GraderBody(BaseModel):
    grader: dict[str, Any] = Field(
        description="A grader in OpenAI's shape: type string_check, text_similarity, python, "
        "score_model or multi, with its fields."
    )


class GraderRunBody(GraderBody):
    model_sample: str = Field(description="The model's answer: {{sample.output_text}}.")
    item: Any = Field(default=None, description="The dataset row: {{item.field}}.")


class GraderValidation(BaseModel):
    grader: dict[str, Any] = Field(description="The grader as it will run (defaults filled).")
    item_fields: list[str] = Field(
        description="Fields of item the templates reference: every data row must have them."
    )


class GraderRunResult(BaseModel):
    reward: float = Field(description="The reward in [0, 1] (0 where the grader failed).")
    sub_rewards: dict[str, float] = Field(
        description="Each grader's score by name (multi: name.key for sub-graders)."
    )
    errors: dict[str, str] = Field(
        description="Graders that failed (exception, limit, or a score outside [0, 1]) and why."
    )
    execution_time: float = Field(description="Seconds spent grading.")


@router.post("/v1/graders/validate", response_model=GraderValidation,
             responses=error_responses(400, 422))
async def validate(body: GraderBody, tenant: CurrentTenant,
                   settings: SettingsDep) -> GraderValidation:
    """Check a grader: every problem, each with its field path, in one 422."""
    from core.spec.graders import item_fields

    g = graders.checked_grader(body.grader, settings)
    return GraderValidation(grader=g.model_dump(mode="json", exclude_none=True),
                            item_fields=sorted(item_fields(g)))


@router.post("/v1/graders/run", response_model=GraderRunResult, responses=error_responses(400, 422))
async def run(body: GraderRunBody, tenant: CurrentTenant, settings: SettingsDep) -> GraderRunResult:
    """Grade one sample against one item, as a GRPO job would score it."""
    g = graders.checked_grader(body.grader, settings)
    item = graders.check_inputs(body.model_sample, body.item)
    r = await run_in_threadpool(graders.run_grader, g, body.model_sample, item, settings)
    return GraderRunResult(reward=r.score.reward, sub_rewards=r.score.sub_scores,
                           errors=r.score.errors, execution_time=r.seconds)


@router.post("/v1/fine_tuning/alpha/graders/validate", responses=error_responses(400, 422))
async def openai_validate(body: GraderBody, tenant: CurrentTenant,
                          settings: SettingsDep) -> dict[str, Any]:
    """OpenAI's GraderValidateResponse: {"grader": ...}."""
    g = graders.checked_grader(body.grader, settings)
    return {"grader": g.model_dump(mode="json", exclude_none=True)}


@router.post("/v1/fine_tuning/alpha/graders/run", responses=error_responses(400, 422))
async def openai_run(body: GraderRunBody, tenant: CurrentTenant,
                     settings: SettingsDep) -> dict[str, Any]:
    """OpenAI's GraderRunResponse: reward, sub_rewards, metadata (errors, scores)."""
    g = graders.checked_grader(body.grader, settings)
    item = graders.check_inputs(body.model_sample, body.item)
    r = await run_in_threadpool(graders.run_grader, g, body.model_sample, item, settings)
    return graders.openai_run_response(r)
