"""model.from_job on a real run: the new job starts from the source's checkpointed adapter.
Every row is the same sentence, so every batch is the same: the continued job's first loss
(computed before its first update) is the source's loss at the step after that checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.jobdirs import events, losses, make_job, of_type, run_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS = [{"text": "the quick brown fox jumps over the lazy dog"}] * 16


def run(root: Path, model: Path, steps: int, **runtime: object) -> Path:
    job = make_job(
        root,
        model,
        ROWS,
        spec={
            "model": {"from_job": "job-source", "step": 2} if runtime else {},
            "training": {"max_steps": steps, "save_steps": 2, "logging_steps": 1},
        },
        runtime=dict(runtime),
    )
    proc = run_trainer(job)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return job


def test_a_job_continues_from_another_jobs_checkpoint(tiny_causal_lm: Path, tmp_path: Path) -> None:
    source = run(tmp_path / "source", tiny_causal_lm, 4)
    trained = losses(events(source))
    assert trained[3] < trained[1]  # it learned: starting over would not give step 3's loss

    job = run(
        tmp_path / "continued",
        tiny_causal_lm,
        1,
        init_adapter=str(source / "checkpoints" / "checkpoint-2"),
    )
    (started,) = of_type(events(job), "started")
    assert started["initialized_from"] == {"job": "job-source", "step": 2}
    assert started["initial_step"] == 0  # a new job: its own steps, optimizer and schedule
    assert losses(events(job))[1] == pytest.approx(trained[3], rel=1e-5)
