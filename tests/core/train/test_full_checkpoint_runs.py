"""Checkpoints of a full fine-tune (peft method full) that travel, on real runs of the tiny
Llama whose LM head is tied to its input embedding.

A checkpoint taken with 2 processes (FSDP2 or FSDP1 over gloo, or DDP) resumes on 1: every parameter
and its optimizer state come back from the DCP state, resharded, and the resumed steps
match an uninterrupted single-process run of the same job (global batch 4 either way: 2 per
device on 2 processes, 2 x 2 accumulated on one) step by step, and end with its weights.
Every checkpoint also holds the model as transformers loads it (``model/``), equal to the
weights at that step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.full_runs import FSDP1, FSDP2, ONE, SAVED, STEPS, checkpoint, full_job
from tests.utils.jobdirs import events, losses, model_weights, of_type
from tests.utils.shared_runs import SharedRuns

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a and set(a) == set(b)
    for name, tensor in a.items():
        torch.testing.assert_close(tensor, b[name], rtol=1e-4, atol=1e-6, msg=name)


# The uninterrupted runs are tests/utils/full_runs.py's, shared with test_full_runs.py.
@pytest.fixture(scope="module")
def one(full_runs: SharedRuns) -> Path:
    """Uninterrupted on 1 process."""
    return full_runs("one")


@pytest.fixture(scope="module")
def fsdp(full_runs: SharedRuns) -> Path:
    """FSDP2 defaults: rank 0 alone reads the weights, every parameter sharded."""
    return full_runs("fsdp2")


@pytest.fixture(scope="module")
def fsdp1(full_runs: SharedRuns) -> Path:
    """FSDP1: flat parameters, SHARDED_STATE_DICT checkpoints."""
    return full_runs("fsdp1")


@pytest.fixture(scope="module")
def ddp(full_runs: SharedRuns) -> Path:
    return full_runs("ddp")


def assert_continues(resumed: Path, uninterrupted: Path, world: dict[str, int]) -> None:
    evs = events(resumed)
    (started,) = of_type(evs, "started")
    assert started["initial_step"] == SAVED
    assert started["resumed_world_size"] == world
    assert started["rebatched"]["global_batch"] == 4
    assert started["gradient_accumulation_steps"] == 2
    assert_same_steps_and_weights(resumed, evs, uninterrupted)


def assert_same_steps_and_weights(resumed: Path, evs: list[dict[str, Any]],
                                  uninterrupted: Path) -> None:
    """The steps after the resume have the uninterrupted run's losses, and it ends on its
    weights."""
    want, got = losses(events(uninterrupted)), losses(evs)
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert_same_weights(model_weights(resumed / "model"), model_weights(uninterrupted / "model"))


def test_every_parameter_and_its_optimizer_state_are_in_the_checkpoint(fsdp: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = checkpoint(fsdp) / "state"
    assert len(list(state.glob("*.distcp"))) == 2  # each rank wrote its shards
    stored = dcp.FileSystemReader(str(state)).read_metadata().state_dict_metadata
    params = {k.removeprefix("model.") for k in stored if k.startswith("model.")}
    assert set(params) == set(model_weights(fsdp / "model"))  # tied head: once, as in the model
    for name in params:
        assert f"optim.state.{name}.exp_avg" in stored, name
        assert f"optim.state.{name}.exp_avg_sq" in stored, name
    manifest = json.loads((checkpoint(fsdp) / "ftune_checkpoint.json").read_text())
    assert (manifest["trainable"], manifest["world_size"]) == ("full", 2)


def test_an_fsdp2_full_checkpoint_resumes_on_one_process(
    one: Path, fsdp: Path, tiny_tied_causal_lm: Path, tmp_path: Path
) -> None:
    job = full_job(tmp_path, tiny_tied_causal_lm, ONE, resume=checkpoint(fsdp))
    assert_continues(job, one, {"from": 2, "to": 1})
    (started,) = of_type(events(job), "started")
    assert started["resumed_strategy"] == {"from": "fsdp", "to": "none"}


def test_an_fsdp1_full_checkpoint_resumes_on_one_process(
    one: Path, fsdp1: Path, tiny_tied_causal_lm: Path, tmp_path: Path
) -> None:
    """Every rank wrote its shards of FSDP1's flat parameters and their optimizer state
    (DCP); one process reads them back whole and continues as if it had run from the
    start."""
    assert len(list((checkpoint(fsdp1) / "state").glob("*.distcp"))) == 2
    job = full_job(tmp_path, tiny_tied_causal_lm, ONE, resume=checkpoint(fsdp1))
    assert_continues(job, one, {"from": 2, "to": 1})
    (started,) = of_type(events(job), "started")
    assert started["resumed_strategy"] == {"from": "fsdp", "to": "none"}


def test_a_ddp_full_checkpoint_resumes_on_one_process(
    one: Path, ddp: Path, tiny_tied_causal_lm: Path, tmp_path: Path
) -> None:
    job = full_job(tmp_path, tiny_tied_causal_lm, ONE, resume=checkpoint(ddp))
    assert_continues(job, one, {"from": 2, "to": 1})


def test_a_single_process_full_checkpoint_resumes_sharded_on_two(
    one: Path, fsdp: Path, tiny_tied_causal_lm: Path, tmp_path: Path
) -> None:
    job = full_job(tmp_path, tiny_tied_causal_lm, FSDP2, resume=checkpoint(one))
    evs = events(job)
    (started,) = of_type(evs, "started")
    assert (started["initial_step"], started["resumed_world_size"]) == (SAVED, {"from": 1, "to": 2})
    assert started["fsdp_unsharded_params"] == 0  # the resumed state went into shards
    assert_same_steps_and_weights(job, evs, fsdp)


def test_a_single_process_full_checkpoint_resumes_under_fsdp1_on_two(
    one: Path, fsdp1: Path, tiny_tied_causal_lm: Path, tmp_path: Path
) -> None:
    """DCP reshards into FSDP1's flat parameters, optimizer state included (the steps after
    the resume, and the final weights, are FSDP1's uninterrupted ones)."""
    job = full_job(tmp_path, tiny_tied_causal_lm, FSDP1, resume=checkpoint(one))
    evs = events(job)
    (started,) = of_type(evs, "started")
    assert (started["initial_step"], started["resumed_world_size"]) == (SAVED, {"from": 1, "to": 2})
    assert started["fsdp_version"] == 1
    assert_same_steps_and_weights(job, evs, fsdp1)


def test_every_checkpoint_holds_the_model_at_that_step(
    fsdp: Path, fsdp1: Path, one: Path, tiny_tied_causal_lm: Path
) -> None:
    """checkpoint-N/model loads with transformers and holds the weights of the DCP state at
    that step (the trained values, cast to the model's dtype), whatever the world size."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from worker.run.adapter_check import artifact_problem

    for job in (fsdp, fsdp1, one):
        folder = checkpoint(job) / "model"
        assert artifact_problem(folder) is None
        assert f"checkpoint at step {SAVED}" in (folder / "README.md").read_text()
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        # The DCP state read whole, on this one process (no process group needed).
        reader = dcp.FileSystemReader(str(checkpoint(job) / "state"))
        meta = reader.read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype)
                 for k, m in meta.items() if k.startswith("model.")}
        dcp.load(state, storage_reader=reader)  # no process group: read here, whole
        for key, want in state.items():
            # FSDP1's state names the tied LM head too: the same parameter as the embedding.
            got = model.get_parameter(key.removeprefix("model."))
            assert torch.equal(got, want.to(got.dtype)), key
        base = AutoModelForCausalLM.from_pretrained(tiny_tied_causal_lm)
        assert not torch.equal(base.model.embed_tokens.weight, model.model.embed_tokens.weight)
