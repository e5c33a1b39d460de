"""select_best's choice among a job's scored models (core/evals/job_evaluation.py): pure."""

from __future__ import annotations

from core.evals.job_evaluation import choose_best
from core.evals.job_results import CriterionScore, ModelScore
from core.spec.evaluation import SelectBest, Stage

RULE = SelectBest(eval_id="eval-1", criterion="exact")


def score(stage: Stage, step: int | None, model: str, rate: float) -> ModelScore:
    return ModelScore(stage=stage, step=step, model=model, eval_id="eval-1", run_id="r",
                      status="completed", result_counts={},
                      criteria={"exact": CriterionScore(pass_rate=rate, mean_score=rate)})


def test_the_highest_pass_rate_wins_and_the_base_never_does() -> None:
    best = choose_best([score("base", None, "base", 1.0), score("checkpoints", 8, "c8", 0.5),
                        score("checkpoints", 16, "c16", 0.75), score("final", None, "f", 0.5)],
                       RULE)
    assert best is not None and (best.model, best.step, best.score) == ("c16", 16, 0.75)
    assert best.reason.startswith("best by exact pass_rate of eval-1: c16 (0.750")


def test_of_equal_figures_the_fewest_steps_win_a_checkpoint_before_the_final() -> None:
    scores = [score("checkpoints", 8, "c8", 0.5), score("checkpoints", 16, "c16", 1.0),
              score("checkpoints", 24, "c24", 1.0), score("final", None, "f", 1.0)]
    assert choose_best(scores, RULE).model == "c16"  # type: ignore[union-attr]
    assert choose_best([scores[2], scores[3]], RULE).model == "c24"  # type: ignore[union-attr]


def test_nothing_graded_chooses_nothing() -> None:
    empty = ModelScore(stage="checkpoints", step=8, model="c8", eval_id="eval-1", run_id="r",
                       status="completed", result_counts={},
                       criteria={"exact": CriterionScore(pass_rate=None, mean_score=None)})
    assert choose_best([empty], RULE) is None
