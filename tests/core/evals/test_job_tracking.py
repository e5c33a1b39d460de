"""Evaluation scores beside a job's other figures (core/evals/job_tracking.py): their names,
and a tracker that cannot continue its run. The scores reaching real TensorBoard, MLflow and
W&B runs after a real training run: tests/core/train/test_tracking_run.py."""

from __future__ import annotations

from pathlib import Path

from core.db.models import Job
from core.evals.job_results import CriterionScore, ModelScore
from core.evals.job_tracking import ScoreTracking, score_figures
from tests.utils.jobdirs import make_job
from tests.utils.tiny import text_rows


def scored(criteria: dict[str, CriterionScore]) -> ModelScore:
    return ModelScore(stage="checkpoints", step=2, model="m", eval_id="eval_1", run_id="r",
                      status="completed", result_counts={}, criteria=criteria)


def test_each_criterion_gives_a_pass_rate_and_a_mean_score_by_name() -> None:
    figures = score_figures(scored({"exact": CriterionScore(pass_rate=0.5, mean_score=0.75),
                                    "a/b:c": CriterionScore(pass_rate=1.0, mean_score=1.0)}))
    assert figures == {"evals/eval_1/exact/pass_rate": 0.5,
                       "evals/eval_1/exact/mean_score": 0.75,
                       # MLflow refuses ':' in a name; a '/' would nest a level deeper.
                       "evals/eval_1/a_b_c/pass_rate": 1.0,
                       "evals/eval_1/a_b_c/mean_score": 1.0}


def test_a_criterion_nothing_was_graded_on_has_no_figures() -> None:
    assert score_figures(scored({"x": CriterionScore(pass_rate=None, mean_score=None)})) == {}


def test_a_job_without_trackers_logs_nowhere_and_says_nothing(tmp_path: Path) -> None:
    job = make_job(tmp_path, "org/m", text_rows(4))
    trackers = ScoreTracking(Job(id="job-test", job_dir=str(job), step=6))
    trackers.log(scored({"exact": CriterionScore(pass_rate=0.5, mean_score=0.5)}))
    trackers.close("FINISHED")
    assert trackers.tracking.trackers == [] and trackers.take_events() == []


def test_a_tracker_that_cannot_continue_its_run_costs_the_scores_not_the_job(
        tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    job = make_job(tmp_path, "org/m", text_rows(4), spec={"tracking": {"report_to": ["mlflow"]}},
                   runtime={"tracking": {"report_to": ["mlflow"], "mlflow": {
                       "tracking_uri": f"sqlite:///{blocker}/x/mlflow.db",
                       "experiment_name": "e", "ui_url": None}}})
    trackers = ScoreTracking(Job(id="job-test", job_dir=str(job), step=6))
    trackers.log(scored({"exact": CriterionScore(pass_rate=0.5, mean_score=0.5)}))
    trackers.close("FINISHED")
    (warning,) = trackers.take_events()
    assert (warning.job_id, warning.type, warning.data["level"]) == ("job-test", "log", "warning")
    assert warning.message.startswith("tracking: mlflow could not start")
    assert warning.message.endswith("the evaluation scores are not in the job's tracker runs")
