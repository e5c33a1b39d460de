"""Checkpoints that travel (core/train/checkpoint.py), on real runs of a tiny Llama.

A checkpoint taken with N processes resumes with M: DDP 2 -> 1, FSDP2 (2 CPU processes over
gloo) -> 1, 1 -> FSDP2 2. The resumed run keeps the checkpoint's global batch (per-device
batch x accumulation x processes), so its steps continue the same data. What it must match
is an uninterrupted run on M processes of the same job: the 2-process reference (DDP) and
the 1-process run (batch 2 x accumulation 2) are that, and they agree with each other (the
first test), as a global batch that does not depend on the world size says they must.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.adapters import assert_loads, assert_same_adapter
from tests.utils.jobdirs import events, launch, losses, of_type
from tests.utils.lora_runs import FSDP2, ONE, SAVED, STEPS, checkpoint, lora_job
from tests.utils.shared_runs import SharedRuns

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# The uninterrupted runs are tests/utils/lora_runs.py's, shared with test_fsdp_runs.py.
@pytest.fixture(scope="module")
def two(lora_runs: SharedRuns) -> Path:
    """Uninterrupted on 2 processes (DDP)."""
    return lora_runs("ddp")


@pytest.fixture(scope="module")
def one(lora_runs: SharedRuns) -> Path:
    """Uninterrupted on 1 process."""
    return lora_runs("one")


@pytest.fixture(scope="module")
def sharded(lora_runs: SharedRuns) -> Path:
    """Uninterrupted on 2 processes (FSDP2, every rank reads the weights)."""
    return lora_runs("fsdp2")


def assert_continues(resumed: Path, uninterrupted: Path, world: dict[str, int]) -> None:
    """The resumed run logs steps SAVED+1.. with the uninterrupted run's losses, says the
    world size changed, and ends with its adapter."""
    evs = events(resumed)
    (started,) = of_type(evs, "started")
    assert started["initial_step"] == SAVED
    assert started["resumed_world_size"] == world
    assert started["rebatched"]["global_batch"] == 4
    want, got = losses(events(uninterrupted)), losses(evs)
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert_same_adapter(resumed / "adapter", uninterrupted / "adapter")


def test_one_and_two_processes_train_alike_with_the_same_global_batch(
    one: Path, two: Path
) -> None:
    want, got = losses(events(two)), losses(events(one))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_every_checkpoint_is_dcp_state_plus_a_loadable_adapter(
    one: Path, two: Path, tiny_causal_lm: Path
) -> None:
    import json

    for job, world in ((one, 1), (two, 2)):
        ckpt = checkpoint(job)
        # Each rank wrote its own file of the trainable state and optimizer state.
        assert len(list((ckpt / "state").glob("*.distcp"))) == world
        manifest = json.loads((ckpt / "ftune_checkpoint.json").read_text())
        assert (manifest["world_size"], manifest["global_batch"], manifest["step"]) == (
            world,
            4,
            SAVED,
        )
        assert manifest["trainable"] == "adapter"
        assert_loads(tiny_causal_lm, ckpt)


def test_a_ddp_checkpoint_resumes_on_one_process(
    two: Path, one: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    job = lora_job(tmp_path, tiny_causal_lm, ONE, resume=checkpoint(two))
    launch(job)
    assert_continues(job, one, {"from": 2, "to": 1})
    (started,) = of_type(events(job), "started")
    assert started["gradient_accumulation_steps"] == 2


def test_an_fsdp2_checkpoint_resumes_on_one_process(
    one: Path, sharded: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    ckpt = checkpoint(sharded)
    assert len(list((ckpt / "state").glob("*.distcp"))) == 2
    job = lora_job(tmp_path / "resumed", tiny_causal_lm, ONE, resume=ckpt)
    launch(job)
    assert_continues(job, one, {"from": 2, "to": 1})
    (started,) = of_type(events(job), "started")
    assert started["resumed_strategy"] == {"from": "fsdp", "to": "none"}


def test_a_single_process_checkpoint_resumes_sharded_on_two(
    one: Path, two: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    job = lora_job(tmp_path, tiny_causal_lm, FSDP2, resume=checkpoint(one))
    launch(job)
    assert_continues(job, two, {"from": 1, "to": 2})
    (started,) = of_type(events(job), "started")
    assert started["fsdp_unsharded_params"] == 0  # the resumed state was loaded into shards
    assert started["gradient_accumulation_steps"] == 1
