"""Full-parameter fine-tuning (peft method full) for real on 2 CPU processes: DDP, FSDP1 and
FSDP2 over gloo (the operator's FTUNE_CPU_FSDP2 route) and DeepSpeed ZeRO-3 with parameters
and optimizer offloaded to the CPU, all on the tiny Llama whose LM head is tied to its input
embedding (the layout that broke FSDP2's wrapping). The four must train alike and save the
same whole model, which transformers loads and generates with, and the same model at their
checkpoint (``checkpoint-N/model``, which every strategy writes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from core.train.full_model import INDEX_FILE, sha256_of
from tests.utils.full_runs import SAVED, STEPS
from tests.utils.jobdirs import events, losses, model_weights, of_type
from tests.utils.shared_runs import SharedRuns

# The ZeRO-3 run waits for DeepSpeed's CPU ops when another tree's venv rebuilt them (the
# cpu_adam fixture, conftest.py, builds them outside the run's timeout).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]


# The runs are tests/utils/full_runs.py's, shared with test_full_checkpoint_runs.py.
@pytest.fixture(scope="module")
def ddp_full(full_runs: SharedRuns) -> Path:
    return full_runs("ddp")


@pytest.fixture(scope="module")
def fsdp_full(full_runs: SharedRuns) -> Path:
    """FSDP2 defaults: FULL_SHARD, cpu_ram_efficient_loading (rank 0 alone reads weights)."""
    return full_runs("fsdp2")


@pytest.fixture(scope="module")
def fsdp1_full(full_runs: SharedRuns) -> Path:
    return full_runs("fsdp1")


@pytest.fixture(scope="module")
def zero3_full(cpu_adam: float, full_runs: SharedRuns) -> Path:
    return full_runs("zero3_offload")


@pytest.fixture(scope="module")
def zero3_local_full(shm_comm: float, full_runs: SharedRuns) -> Path:
    """ZeRO-3 without offload: the float32 partitions are their own fp32 master."""
    return full_runs("zero3")


def test_fsdp2_shards_every_parameter_and_rank_0_alone_reads_weights(fsdp_full: Path) -> None:
    evs = events(fsdp_full)
    (started,) = of_type(evs, "started")
    assert (started["strategy"], started["method"], started["world_size"]) == ("fsdp", "full", 2)
    assert started["trainable_params"] == started["total_params"]
    assert started["fsdp_sharded_params"] > 0 and started["fsdp_unsharded_params"] == 0
    assert 0.45 <= started["fsdp_largest_param_local_fraction"] <= 0.55
    loads = {e["rank"]: e for e in of_type(evs, "memory") if e["phase"] == "load"}
    assert loads[0]["weights_read_mb"] > 0 and loads[1]["weights_read_mb"] == 0


def test_fsdp1_wraps_the_model_in_units_that_each_hold_half(fsdp1_full: Path) -> None:
    (started,) = of_type(events(fsdp1_full), "started")
    assert (started["strategy"], started["fsdp_version"], started["world_size"]) == ("fsdp", 1, 2)
    assert started["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert started["fsdp_units"] >= 2  # the decoder layers, and the root
    assert started["trainable_params"] == started["total_params"]
    mb = started["param_mb_per_rank"]  # each rank's part of the flat parameters
    whole = started["total_params"] * 4 / 2**20
    assert all(0.45 * whole <= m <= 0.55 * whole for m in mb), (mb, whole)
    state = fsdp1_full / "checkpoints" / f"checkpoint-{SAVED}" / "state"
    assert len(list(state.glob("*.distcp"))) == 2  # every rank wrote its shards


def test_zero3_partitions_at_load_and_offloads(zero3_full: Path) -> None:
    (started,) = of_type(events(zero3_full), "started")
    assert (started["zero_stage"], started["offload_param_device"],
            started["offload_optimizer_device"]) == (3, "cpu", "cpu")
    assert started["params_partitioned_at_load"] is True
    assert started["trainable_params"] == started["total_params"]


def test_ddp_fsdp1_fsdp2_and_zero3_train_alike_and_save_the_same_model(
    ddp_full: Path, fsdp1_full: Path, fsdp_full: Path, zero3_full: Path
) -> None:
    want = losses(events(ddp_full))
    assert sorted(want) == list(range(1, STEPS + 1))
    for job in (fsdp1_full, fsdp_full, zero3_full):
        got = losses(events(job))
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (job, step)
    ref = model_weights(ddp_full / "model")
    assert "lm_head.weight" not in ref  # tied: saved once, as transformers does
    for job in (fsdp1_full, fsdp_full, zero3_full):
        got = model_weights(job / "model")
        assert set(got) == set(ref)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_zero3_without_offload_keeps_no_second_fp32_copy_and_trains_like_ddp(
    ddp_full: Path, zero3_local_full: Path
) -> None:
    """core/train/sharding.py alias_fp32_master: DeepSpeed's fp32 master partition became the
    float32 parameter partition (its half of the model's bytes freed on this rank), and the
    run's losses and saved model are still DDP's."""
    (started,) = of_type(events(zero3_local_full), "started")
    assert (started["zero_stage"], started["offload_optimizer_device"]) == (3, "none")
    half_mb = 4 * started["total_params"] / 2 / 2**20
    assert started["zero_fp32_master_aliased_mb"] == pytest.approx(half_mb, rel=0.05)
    want = losses(events(ddp_full))
    got = losses(events(zero3_local_full))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    ref = model_weights(ddp_full / "model")
    got_model = model_weights(zero3_local_full / "model")
    assert set(got_model) == set(ref)
    for name in ref:
        torch.testing.assert_close(got_model[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_every_strategy_checkpoints_the_model_at_that_step(
    ddp_full: Path, fsdp1_full: Path, fsdp_full: Path, zero3_full: Path
) -> None:
    """checkpoint-N/model, under DDP, FSDP1 (from its sharded state dict), FSDP2 and ZeRO-3
    (whose engine checkpoint holds no downloadable model): a model transformers loads,
    with the same weights whatever the strategy."""
    from transformers import AutoModelForCausalLM

    from worker.run.adapter_check import artifact_problem

    def at_step(job: Path) -> Path:
        return job / "checkpoints" / f"checkpoint-{SAVED}" / "model"

    ref = model_weights(at_step(ddp_full))
    assert ref and not torch.equal(ref["model.norm.weight"],
                                   model_weights(ddp_full / "model")["model.norm.weight"])
    for job in (ddp_full, fsdp1_full, fsdp_full, zero3_full):
        folder = at_step(job)
        assert artifact_problem(folder) is None, job
        assert f"checkpoint at step {SAVED}" in (folder / "README.md").read_text()
        got = model_weights(folder)
        assert set(got) == set(ref), job
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("strategy", ["fsdp_full", "fsdp1_full"])
def test_the_final_model_loads_generates_and_lists_its_files(
    strategy: str, request: pytest.FixtureRequest, tiny_tied_causal_lm: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.run.adapter_check import artifact_problem

    fsdp_full: Path = request.getfixturevalue(strategy)
    folder = fsdp_full / "model"
    assert artifact_problem(folder) is None
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "README.md",
            INDEX_FILE, "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "files.json"} <= names
    assert "sharded" not in names and not (fsdp_full / "model.tmp").exists()
    listed = json.loads((folder / "files.json").read_text())["files"]
    assert {e["name"] for e in listed} == names - {"files.json"}
    for e in listed:
        assert (e["bytes"], e["sha256"]) == ((folder / e["name"]).stat().st_size,
                                             sha256_of(folder / e["name"]))
    card = (folder / "README.md").read_text()
    assert "library_name: transformers" in card and "every parameter" in card
    assert f"| steps | {STEPS} |" in card

    model = AutoModelForCausalLM.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(tiny_tied_causal_lm)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    changed = [n for n, p in base.named_parameters()
               if not torch.equal(p, model.get_parameter(n))]
    assert len(changed) == len(list(base.parameters()))  # every parameter trained
    tok = AutoTokenizer.from_pretrained(folder)
    out = model.generate(**tok(["the quick"], return_tensors="pt"), max_new_tokens=4,
                         do_sample=False)
    assert out.shape[1] > 2


def test_verification_finds_a_file_that_differs_from_the_trained_weights(
    ddp_full: Path, tmp_path: Path
) -> None:
    """verify_files, as the trainer runs it before publishing (here on one process)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from core.train.full_model import plan_files, saved_tensors, verify_files

    folder = shutil.copytree(ddp_full / "model", tmp_path / "model")
    trained = AutoModelForCausalLM.from_pretrained(folder)
    params = saved_tensors(trained)
    index = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    mapping = {name: int(index[name].split("-")[1]) for name, _ in params}
    assert plan_files([(n, p.numel() * 4) for n, p in params], 2) == mapping
    assert verify_files(params, mapping, folder, torch.float32) == []
    # One value of one tensor changed on disk: the file no longer holds what was trained.
    first = folder / "model-00001-of-00002.safetensors"
    tensors = load_file(str(first))
    name = next(iter(tensors))
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, str(first), metadata={"format": "pt"})
    assert verify_files(params, mapping, folder, torch.float32) == [
        f"{name}: the file differs from the trained weights"]
