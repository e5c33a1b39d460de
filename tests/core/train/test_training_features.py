"""Training options end to end: determinism, gradient checkpointing, NEFTune, schedule with
warmup, checkpoint pruning (save_total_limit) and resuming from a named checkpoint."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.train.arguments import training_arguments
from core.train.job import load_job
from tests.utils.jobdirs import events, make_job, of_type
from tests.utils.tiny import text_rows

STEPS = 6
SCHEDULE = {
    "max_steps": STEPS,
    "logging_steps": 1,
    "learning_rate": 1e-2,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.5,
    "weight_decay": 0.1,
    "max_grad_norm": 0.5,
    "seed": 7,
}


def _run(root: Path, model: Path, run_main: Callable[[Path], int], **training: Any) -> list[dict]:
    job = make_job(root, model, text_rows(32), spec={"training": {**SCHEDULE, **training}})
    assert run_main(job) == 0
    return events(job)


def _losses(evs: list[dict]) -> list[float]:
    return [e["loss"] for e in of_type(evs, "progress") if "loss" in e]


def _norms(evs: list[dict]) -> list[float]:
    return [e["grad_norm"] for e in of_type(evs, "progress") if "loss" in e]


def test_training_arguments_carry_the_spec(tiny_causal_lm: Path, tmp_path: Path) -> None:
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(4),
        spec={
            "training": {
                **SCHEDULE,
                "gradient_checkpointing": True,
                "neftune_noise_alpha": 5.0,
                "save_total_limit": 2,
            }
        },
    )
    args = training_arguments(load_job(job), has_eval=False)
    assert str(args.lr_scheduler_type.value) == "cosine"
    assert (args.warmup_steps, args.get_warmup_steps(STEPS)) == (0.5, 3)
    assert (args.weight_decay, args.max_grad_norm, args.seed) == (0.1, 0.5, 7)
    assert (args.neftune_noise_alpha, args.save_total_limit) == (5.0, 2)
    assert args.activation_checkpointing is True


@pytest.fixture(scope="module")
def baseline(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from core.train.__main__ import main

    return _run(tmp_path_factory.mktemp("baseline"), tiny_causal_lm, lambda j: main([str(j)]))


def test_same_seed_same_loss_curve(
    baseline: list[dict], tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    again = _run(tmp_path, tiny_causal_lm, run_main)
    assert len(_losses(baseline)) == STEPS
    assert _losses(again) == _losses(baseline)  # bit for bit


def test_warmup_then_cosine_decay(baseline: list[dict]) -> None:
    lrs = [e["learning_rate"] for e in of_type(baseline, "progress") if "loss" in e]
    # The rate each step trained with: 3 warmup steps rising linearly from 0 (warmup_ratio
    # 0.5 of 6 steps), then a cosine from the peak towards 0.
    peak = SCHEDULE["learning_rate"]
    assert lrs[:3] == pytest.approx([0.0, peak / 3, 2 * peak / 3])
    assert lrs[3:] == pytest.approx([peak * (1 + math.cos(math.pi * k / 3)) / 2 for k in (0, 1, 2)])


def test_gradient_checkpointing_with_peft_gives_the_same_curve(
    baseline: list[dict], tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    evs = _run(tmp_path, tiny_causal_lm, run_main, gradient_checkpointing=True)
    (started,) = of_type(evs, "started")
    assert started["gradient_checkpointing"] is True
    # Recomputing activations in backward changes memory, not the numbers: the adapter gets
    # the same gradients through the checkpointed blocks (a cut graph would give norm 0).
    assert _losses(evs) == pytest.approx(_losses(baseline), abs=1e-5)
    assert _norms(evs) == pytest.approx(_norms(baseline), rel=1e-4)
    assert min(_norms(evs)) > 0


def test_neftune_adds_noise_to_training(
    baseline: list[dict], tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    evs = _run(tmp_path, tiny_causal_lm, run_main, neftune_noise_alpha=50.0)
    losses = _losses(evs)
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[0] != _losses(baseline)[0]  # noisy embeddings from the first step


def test_checkpoints_are_pruned_and_a_named_one_resumes(
    baseline: list[dict], tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(32),
        spec={"training": {**SCHEDULE, "save_steps": 2, "save_total_limit": 2}},
    )
    assert run_main(job) == 0
    first = events(job)
    assert [c["retained_steps"] for c in of_type(first, "checkpoint")] == [[2], [2, 4], [4, 6]]
    on_disk = sorted(p.name for p in (job / "checkpoints").iterdir())
    assert on_disk == ["checkpoint-4", "checkpoint-6"]
    assert _losses(first) == _losses(baseline)

    # Resume from checkpoint-4, not the latest: steps 5 and 6 are trained again, identically.
    body = json.loads((job / "spec.json").read_text())
    body["runtime"].update(
        attempt=2, resume_from_checkpoint=str(job / "checkpoints" / "checkpoint-4")
    )
    (job / "spec.json").write_text(json.dumps(body))
    assert run_main(job) == 0
    second = events(job)[len(first) :]
    (started,) = of_type(second, "started")
    assert (started["initial_step"], started["total_steps"]) == (4, STEPS)
    assert started["resumed_from"] == "checkpoints/checkpoint-4"
    assert [e["step"] for e in of_type(second, "progress")] == [5, 6]
    assert _losses(second) == pytest.approx(_losses(first)[4:], abs=1e-6)
