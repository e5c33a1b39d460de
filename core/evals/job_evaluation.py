"""Evaluation inside fine-tuning, on the worker: once the trainer's artifact is verified and
before the job is final, each model the spec's ``evaluation.on`` names (the base model by its
catalog id, every kept checkpoint as ``ft:...:ckpt-step-N``, the final model by its ``ft:``
name) is scored by a completions run of each named eval, through the serving path like any
run (core/evals/endpoint.py). The runs are ordinary eval runs (GET /v1/evals/{id}/runs),
linked to the job (``eval_runs.job_id``: the serving path serves that job's checkpoints to
them while it is still running) and executed here, on the worker that holds the job: its
slot is the job's, and queuing them for another worker could wait on this one.

The scores go to the job's events (one per model and eval) and to ``jobs.evaluation`` (the
job object's ``evaluation``); ``select_best`` then makes the best checkpoint by one criterion
the job's result: the highest figure wins, of equals the fewest steps (the final model counts
as the last step, a checkpoint of the same step wins: it is the same weights, by name).

A job requeued during its evaluation (its worker died) trains again from its latest
checkpoint, then reuses the completed runs of models whose name is unchanged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import (
    Checkpoint,
    Eval,
    EvalOutputItem,
    EvalRun,
    Job,
    JobEvent,
    Tenant,
)
from core.evals import store
from core.evals.execute import execute_run
from core.evals.job_results import Best, CriterionScore, JobEvaluation, ModelScore
from core.evals.job_tracking import ScoreTracking, add_to_checkpoint
from core.evals.training import source_rows
from core.infra.settings import Settings
from core.serving.names import checkpoint_model_name, model_name_of
from core.spec.evaluation import EvalOnTraining, EvaluationSpec, SelectBest, Stage

log = logging.getLogger(__name__)
EVENT = "evaluation"


def models_to_score(session: Session, job: Job, tenant: Tenant, spec: EvaluationSpec,
                    settings: Settings) -> list[tuple[Stage, int | None, str]]:
    own = model_name_of(job.id, job.name, job.spec or {}, job.openai, settings.model_catalog,
                        tenant.name)
    out: list[tuple[Stage, int | None, str]] = []
    if "base" in spec.on:
        location = str((job.spec or {}).get("model", {}).get("name_or_path", ""))
        base = next(k for k, e in settings.model_catalog.items() if e.location == location)
        out.append(("base", None, base))
    if "checkpoints" in spec.on:
        steps = session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job.id)
                                .order_by(Checkpoint.step))
        out.extend(("checkpoints", s, checkpoint_model_name(own, s)) for s in steps)
    if "final" in spec.on:
        out.append(("final", None, own))
    return out


def evaluate_job(maker: sessionmaker[Session], job_id: str, settings: Settings, *,
                 worker_id: str, adapter_path: str,
                 canceled: Callable[[], bool]) -> JobEvaluation:
    """Score every model the spec names, choose the best; what it found, as written on the
    job. ``adapter_path`` (the verified final artifact) is recorded first: the final model's
    name resolves through it while the job runs. ``canceled`` is asked between runs."""
    with maker() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.spec.get("evaluation")
        tenant = session.get(Tenant, job.tenant_id)
        assert tenant is not None
        spec = EvaluationSpec.model_validate(job.spec["evaluation"])
        session.execute(update(Job).where(Job.id == job_id).values(adapter_path=adapter_path))
        session.commit()
        models = models_to_score(session, job, tenant, spec, settings)
        session.expunge_all()
    trackers = ScoreTracking(job)
    status = "FAILED"  # the tracker runs' end, unless the evaluation gets to one
    try:
        result = _evaluate(maker, job, spec, models, settings, worker_id, canceled, trackers)
        status = {"completed": "FINISHED", "canceled": "KILLED"}.get(result.status, "FAILED")
    finally:
        trackers.close(status)
        if events := trackers.take_events():
            _write(maker, job_id, None, *events)
    return result


def _evaluate(maker: sessionmaker[Session], job: Job, spec: EvaluationSpec,
              models: list[tuple[Stage, int | None, str]], settings: Settings, worker_id: str,
              canceled: Callable[[], bool], trackers: ScoreTracking) -> JobEvaluation:
    job_id = job.id
    result = JobEvaluation(status="running")
    total = len(models) * len(spec.evals)
    for stage, step, model in models:
        for e in spec.evals:
            _write(maker, job_id, result, phase={
                "phase": "evaluating", "attempt": job.attempt,
                "message": f"evaluating: {len(result.scores)} of {total} runs done, now "
                           f"{model} on {e.eval_id}"})
            if canceled():
                result.status = "canceled"
                _write(maker, job_id, result)
                return result
            score = _score(maker, job, e, stage, step, model, settings, worker_id)
            result.scores.append(score)
            trackers.log(score)
            _write(maker, job_id, result, _event(score), *trackers.take_events(), score=score)
            if score.status != store.COMPLETED:
                result.status = "failed"
                result.error = (f"the {stage} model {model!r} could not be evaluated with "
                                f"{e.eval_id}: run {score.run_id} {score.status}: {score.error}")
                _write(maker, job_id, result)
                return result
    result.best = choose_best(result.scores, spec.select_best) if spec.select_best else None
    result.status = "completed"
    events = [] if result.best is None else [JobEvent(
        job_id=job_id, type=EVENT, message=result.best.reason,
        data={"best": result.best.model_dump()})]
    _write(maker, job_id, result, *events)
    return result


def choose_best(scores: list[ModelScore], rule: SelectBest) -> Best | None:
    """The checkpoint (or final model) with the highest figure; of equals, the fewest
    steps, a checkpoint before the final model of the same step."""
    ranked: list[tuple[float, float, int, ModelScore]] = []
    last = max((s.step or 0 for s in scores), default=0)
    for s in scores:
        if s.eval_id != rule.eval_id or s.stage == "base":
            continue
        figure = getattr(s.criteria.get(rule.criterion), rule.by, None)
        if figure is None:
            continue
        step = s.step if s.step is not None else last
        ranked.append((-figure, step, 1 if s.stage == "final" else 0, s))
    if not ranked:
        return None
    ranked.sort(key=lambda r: r[:3])
    figure, _, _, top = ranked[0]
    others = ", ".join(f"{s.model.rsplit(':', 1)[-1]} {-f:.3f}" for f, _, _, s in ranked[1:])
    return Best(model=top.model, step=top.step, eval_id=rule.eval_id, criterion=rule.criterion,
                by=rule.by, score=-figure,
                reason=f"best by {rule.criterion} {rule.by} of {rule.eval_id}: {top.model} "
                       f"({-figure:.3f}; the others: {others or 'none'})")


def _score(maker: sessionmaker[Session], job: Job, e: EvalOnTraining, stage: Stage,
           step: int | None, model: str, settings: Settings, worker_id: str) -> ModelScore:
    run_id = _run(maker, job, e, stage, step, model, settings)
    execute_run(maker, run_id, worker_id=worker_id, settings=settings)
    with maker() as session:
        run = session.get(EvalRun, run_id)
        ev = session.get(Eval, e.eval_id)
        assert run is not None and ev is not None
        items = list(session.execute(select(EvalOutputItem.status, EvalOutputItem.results)
                                     .where(EvalOutputItem.run_id == run_id)))
        names = [c["name"] for c in ev.testing_criteria]
        counts = store.summarize([(st, res, {}) for st, res in items])["result_counts"]
        return ModelScore(stage=stage, step=step, model=model, eval_id=e.eval_id,
                          run_id=run_id, status=run.status, error=run.error_message,
                          result_counts=counts,
                          criteria={n: _criterion(n, [res for _, res in items]) for n in names})


def _criterion(name: str, results: list[list[dict[str, Any]]]) -> CriterionScore:
    graded = [r for rs in results for r in rs if r.get("name") == name and not r.get("error")]
    if not graded:
        return CriterionScore(pass_rate=None, mean_score=None)
    return CriterionScore(pass_rate=sum(bool(r["passed"]) for r in graded) / len(graded),
                          mean_score=sum(float(r.get("score") or 0) for r in graded)
                          / len(graded))


def _run(maker: sessionmaker[Session], job: Job, e: EvalOnTraining, stage: Stage,
         step: int | None, model: str, settings: Settings) -> str:
    """The run of ``e`` on ``model`` for this job: a completed one from an earlier attempt,
    else a new one (queued: execute_run claims it)."""
    with maker() as session:
        done = session.scalar(select(EvalRun.id).where(
            EvalRun.job_id == job.id, EvalRun.eval_id == e.eval_id, EvalRun.model == model,
            EvalRun.status == store.COMPLETED))
        if done is not None:
            return done
        rows = source_rows(session, job.tenant_id, settings, e.source) or []
        ds = {"type": "completions", "model": model,
              **e.model_dump(mode="json", exclude_none=True, exclude={"eval_id"})}
        meta = {"ftune_job_id": job.id, "stage": stage}
        if step is not None:
            meta["step"] = str(step)
        run = EvalRun(eval_id=e.eval_id, tenant_id=job.tenant_id, job_id=job.id,
                      name=f"{job.id} {stage}" + (f" step {step}" if step is not None else ""),
                      meta=meta, model=model, data_source=ds, status=store.QUEUED,
                      items_total=len(rows), attempt=0, generation_seconds=0.0,
                      grading_seconds=0.0)
        session.add(run)
        session.commit()
        return run.id


def _event(s: ModelScore) -> JobEvent:
    figures = ", ".join(f"{n} {c.pass_rate:.3f}" for n, c in s.criteria.items()
                        if c.pass_rate is not None)
    where = f"step {s.step}" if s.step is not None else s.stage
    return JobEvent(type=EVENT, message=f"{where} ({s.model}) on {s.eval_id}: {s.status}"
                    f"{'; pass rates ' + figures if figures else ''}",
                    data={"score": s.model_dump()})


def _write(maker: sessionmaker[Session], job_id: str, result: JobEvaluation | None,
           *events: JobEvent, phase: dict[str, Any] | None = None,
           score: ModelScore | None = None) -> None:
    """What the evaluation found so far on the job (``result``; None: only ``events``), a
    new ``score`` on its checkpoint too, in one transaction."""
    with maker() as session:
        values: dict[str, Any] = {}
        if result is not None:
            values["evaluation"] = result.model_dump(mode="json")
        if phase is not None:
            values["phase"] = phase
        if values:
            session.execute(update(Job).where(Job.id == job_id).values(**values))
        if score is not None:
            add_to_checkpoint(session, job_id, score)
        for ev in events:
            ev.job_id = job_id
            session.add(ev)
        session.commit()
