"""A job's evaluation scores (core/evals/job_evaluation.py) where its other figures are: the
job's tracker runs and its checkpoints' metrics.

Trackers: the worker scores the models after the trainer has closed its runs, so it
continues them (core/run/trackers.py finds the MLflow and W&B run by the job id; TensorBoard
gets one more event file in the job's directory) with the same destinations the trainer had
(spec.json ``runtime.tracking``) and the spec as the trainer logged it (a continued MLflow run
accepts its params again only with the same values). Each score is logged at the step of the
model scored: the base at 0, a checkpoint at its step, the final model at the job's last
step; as ``evals/<eval>/<criterion>/pass_rate`` and ``.../mean_score``. A tracker that cannot
continue its run costs the job its scores there, not its result: a warning event says so.

Checkpoints: GET /v1/jobs/{id}/checkpoints shows each checkpoint's scores beside its loss, in
its ``metrics`` under the same names.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.models import Checkpoint, Job, JobEvent
from core.evals.job_results import ModelScore
from core.infra.errors import TrainFailure
from core.run.jobdir import JobDir
from core.run.trackers import Tracking, score_metric
from core.spec.job import JobSpec

log = logging.getLogger(__name__)


def score_figures(score: ModelScore) -> dict[str, float]:
    """A score's figures by tracker name (criteria nothing was graded on are left out)."""
    out: dict[str, float] = {}
    for name, c in score.criteria.items():
        for figure in ("pass_rate", "mean_score"):
            value = getattr(c, figure)
            if value is not None:
                out[score_metric(score.eval_id, name, figure)] = float(value)
    return out


class ScoreTracking:
    """The job's tracker runs, continued for its scores; the events they raise wait in
    ``pending`` for the caller's next write."""

    def __init__(self, job: Job) -> None:
        self.job_id = job.id
        self.last_step = job.step or 0
        self.pending: list[JobEvent] = []
        self.tracking = Tracking([], self._emit)
        if not job.job_dir or not (jd := JobDir(Path(job.job_dir))).spec.is_file():
            return
        try:
            plan = jd.read_spec()
            runtime, spec = plan.get("runtime") or {}, plan.get("spec") or {}
            conf = runtime.get("tracking")
            if not conf or not conf.get("report_to"):
                return
            self.tracking = Tracking.open(
                jd.root, conf, str(runtime.get("job_id") or job.id),
                JobSpec.model_validate(spec).model_dump(mode="json"), self._emit,
                announce=False)
        except (TrainFailure, ValueError, OSError) as e:
            log.warning("job %s: trackers not continued for its scores", job.id, exc_info=True)
            self._emit("log", level="warning", message=f"{e}: the evaluation scores are "
                       "not in the job's tracker runs")

    def _emit(self, event_type: str, **fields: Any) -> None:
        self.pending.append(JobEvent(job_id=self.job_id, type=event_type,
                                     message=str(fields.get("message", "")), data=fields))

    def log(self, score: ModelScore) -> None:
        step = 0 if score.stage == "base" else score.step if score.step is not None \
            else self.last_step
        self.tracking.log_scores(score_figures(score), step)

    def close(self, status: str) -> None:
        """End the runs with MLflow's ``status`` (FINISHED, FAILED or KILLED)."""
        self.tracking.finish(None, status)

    def take_events(self) -> list[JobEvent]:
        out, self.pending = self.pending, []
        return out


def add_to_checkpoint(session: Session, job_id: str, score: ModelScore) -> None:
    """A checkpoint's score into its row's metrics (in the caller's transaction)."""
    if score.stage != "checkpoints" or score.step is None:
        return
    row = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id,
                                                  Checkpoint.step == score.step))
    if row is not None:
        row.metrics = {**(row.metrics or {}), **score_figures(score)}
