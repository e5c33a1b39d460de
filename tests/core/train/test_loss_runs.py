"""The fused LM head (core/train/loss.py) in real multi-process runs: two CPU processes
launched as the worker launches them, under DDP (gloo), FSDP2 (the CPU route,
runtime.cpu_fsdp2) and DeepSpeed ZeRO-3, each run with the fused head and compared with one
run of the plain head (runtime.lm_head plain) under DDP, the reference every sharded
strategy is held to (tests/core/train/test_fsdp_runs.py, test_preference_sharded_runs.py).

Completion-only data with gradient accumulation: the micro-batches of each rank carry
different numbers of loss tokens, so only the same normalisation (the label count of the
whole accumulated batch over all ranks) and, under FSDP2 and ZeRO-3, the whole LM head
weight reaching the tiled head give the same losses, gradient norms and adapter.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.utils.adapters import assert_same_adapter
from tests.utils.jobdirs import events, launch, make_job, of_type
from tests.utils.tiny import prompt_completion_rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp", "num_processes": 2},
    "fsdp2": {
        "strategy": "fsdp",
        "num_processes": 2,
        "fsdp": {"version": 2, "cpu_ram_efficient_loading": False},
    },
    "zero3": {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 3}},
}
STEPS = 4


def loss_job(root: Path, model: Path, distributed: dict[str, Any], lm_head: str) -> Path:
    return make_job(
        root / lm_head,
        model,
        prompt_completion_rows(64),
        spec={
            "dataset": {"format": "prompt_completion", "max_seq_length": 64},
            "training": {
                "max_steps": STEPS,
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "logging_steps": 1,
                "save_steps": STEPS,
                "learning_rate": 1e-2,
            },
            "distributed": distributed,
        },
        runtime={"cpu_fsdp2": distributed["strategy"] == "fsdp", "lm_head": lm_head},
    )


def progress(job: Path) -> dict[int, tuple[float, float]]:
    """(loss, grad_norm) by step."""
    return {
        e["step"]: (e["loss"], e["grad_norm"]) for e in of_type(events(job), "progress")
        if "loss" in e
    }


@pytest.fixture(scope="module")
def plain(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plain head under DDP: one reference for the fused head under every strategy."""
    job = loss_job(tmp_path_factory.mktemp("plain"), tiny_causal_lm, STRATEGIES["ddp"], "plain")
    launch(job, timeout=600)
    (started,) = of_type(events(job), "started")
    assert started["lm_head"] == "plain (runtime.lm_head plain)"
    return job


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_fused_head_trains_like_the_plain_head(
    name: str, plain: Path, tiny_causal_lm: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    distributed = STRATEGIES[name]
    if distributed["strategy"] == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed (extra: deepspeed)")
        # Nothing offloaded: no cpu_adam, only the collectives op, built outside the timeout.
        request.getfixturevalue("shm_comm")
    fused = loss_job(tmp_path, tiny_causal_lm, distributed, "auto")
    launch(fused, timeout=600)

    (started,) = of_type(events(fused), "started")
    assert (started["strategy"], started["world_size"]) == (distributed["strategy"], 2)
    if name == "fsdp2":
        assert started["fsdp_sharded_params"] > 0 and started["fsdp_unsharded_params"] == 0
    if name == "zero3":
        assert started["zero_stage"] == 3
    assert started["lm_head"] == "fused"

    want, got = progress(plain), progress(fused)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-4, abs=1e-6), step
    assert_same_adapter(fused / "adapter", plain / "adapter", rtol=1e-4, atol=1e-6)
