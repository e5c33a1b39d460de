"""FSDP2 for real on two CPU processes over gloo: ``accelerate launch`` of core.train with the
YAML, layer classes and env the worker generates when the operator allows FSDP2 on CPU
(runtime.cpu_fsdp2, from FTUNE_CPU_FSDP2).

Each FSDP run is compared with a DDP run of the same seed and data: the same losses and the
same final adapter. That catches the upstream trap where an FSDP2 FULL_STATE_DICT save holds
only rank 0's slice of each LoRA tensor (accelerate issue 4206): such a file would have the
right names and shapes but half of its values wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.adapters import adapter, assert_loads, assert_same_adapter
from tests.utils.jobdirs import events, launch, launch_and_stop, losses, of_type, resume
from tests.utils.lora_runs import DDP, SAVED, STEPS, fsdp, lora_job
from tests.utils.shared_runs import SharedRuns

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# The runs to compare are tests/utils/lora_runs.py's, shared with test_checkpoint_runs.py.
@pytest.fixture(scope="module")
def ddp_run(lora_runs: SharedRuns) -> Path:
    return lora_runs("ddp")


@pytest.fixture(scope="module")
def fsdp_run(lora_runs: SharedRuns) -> Path:
    """SHARDED_STATE_DICT checkpoints, every rank reads the weights, merged export on."""
    return lora_runs("fsdp2")


def test_fsdp2_shards_the_model_over_gloo(fsdp_run: Path, ddp_run: Path) -> None:
    (started,) = of_type(events(fsdp_run), "started")
    assert (started["strategy"], started["distributed_type"], started["world_size"]) == (
        "fsdp",
        "FSDP",
        2,
    )
    assert (started["fsdp_version"], started["fsdp_state_dict_type"]) == (2, "SHARDED_STATE_DICT")
    # Parameters are DTensors; each rank holds about half of the largest one.
    assert started["fsdp_sharded_params"] > 0 and started["fsdp_unsharded_params"] == 0
    assert 0.45 <= started["fsdp_largest_param_local_fraction"] <= 0.55
    # Per rank, about 1/world of the parameter bytes that every DDP rank holds.
    (ddp_started,) = of_type(events(ddp_run), "started")
    ddp_mb = ddp_started["param_mb_per_rank"]
    assert len(started["param_mb_per_rank"]) == 2
    for mb in started["param_mb_per_rank"]:
        assert 0.4 < mb / ddp_mb[0] < 0.6, (started["param_mb_per_rank"], ddp_mb)


def test_fsdp2_trains_like_ddp_and_saves_the_same_consolidated_adapter(
    fsdp_run: Path, ddp_run: Path, tiny_causal_lm: Path
) -> None:
    want, got = losses(events(ddp_run)), losses(events(fsdp_run))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert_same_adapter(fsdp_run / "adapter", ddp_run / "adapter")
    assert_loads(tiny_causal_lm, fsdp_run / "adapter")


def test_sharded_checkpoints_hold_a_loadable_adapter(fsdp_run: Path, tiny_causal_lm: Path) -> None:
    for step in (SAVED, STEPS):
        ckpt = fsdp_run / "checkpoints" / f"checkpoint-{step}"
        # The adapter and its optimizer state as per-rank shards (torch.distributed.checkpoint,
        # core/train/checkpoint.py) ...
        assert len(list((ckpt / "state").glob("*.distcp"))) == 2
        # ... and the adapter gathered beside them, so the checkpoint can be downloaded.
        assert_loads(tiny_causal_lm, ckpt)
    assert_same_adapter(fsdp_run / "checkpoints" / f"checkpoint-{STEPS}", fsdp_run / "adapter")


def test_export_merged_under_fsdp2(fsdp_run: Path, tiny_causal_lm: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = [e for e in of_type(events(fsdp_run), "saved") if e["path"] == "merged"]
    assert saved and "model.safetensors" in saved[0]["files"]
    merged = AutoModelForCausalLM.from_pretrained(fsdp_run / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm)
    reference = PeftModel.from_pretrained(base, fsdp_run / "adapter").merge_and_unload().eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.fixture(scope="module")
def stopped_and_resumed(
    tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, int, list[dict[str, Any]], list[dict[str, Any]]]:
    """A run with FSDP2's defaults (rank 0 alone reads the weights, cpu_ram_efficient_loading)
    stopped gracefully at step k >= 2 and resumed from its sharded checkpoint-k: (job dir, k,
    events of attempt 1, events of attempt 2). One run for the resume test and the loading
    test: each attempt loads the base the same way."""
    root = tmp_path_factory.mktemp("stopped")
    job = lora_job(root, tiny_causal_lm, fsdp(cpu_ram_efficient_loading=True), save_steps=1)
    k = launch_and_stop(job, at_step=2, log=root / "first-attempt.log")
    first = events(job)
    ckpt = job / "checkpoints" / f"checkpoint-{k}"
    assert 2 <= k < STEPS, f"stopped at step {k}: too late to test a resume"
    assert list((ckpt / "state").glob("*.distcp")) and not (job / "adapter").exists()
    return job, k, first, resume(job, ckpt)


def test_resume_from_a_sharded_checkpoint_continues_steps_and_loss(
    stopped_and_resumed: tuple[Path, int, list[dict[str, Any]], list[dict[str, Any]]],
    fsdp_run: Path,
) -> None:
    job, k, _, resumed = stopped_and_resumed
    want = losses(events(fsdp_run))
    (started,) = of_type(resumed, "started")
    assert started["resumed_from"] == f"checkpoints/checkpoint-{k}"
    assert [e["step"] for e in of_type(resumed, "progress")] == list(range(k + 1, STEPS + 1))
    got = losses(resumed)
    # Weights, Adam moments (from the sharded optimizer state), LR schedule and data order of
    # the uninterrupted run: the same losses.
    for step in range(k + 1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert_same_adapter(job / "adapter", fsdp_run / "adapter")


def test_cpu_ram_efficient_loading_reads_the_weights_on_rank_0_only(
    stopped_and_resumed: tuple[Path, int, list[dict[str, Any]], list[dict[str, Any]]],
    ddp_run: Path,
) -> None:
    job, _, first, resumed = stopped_and_resumed
    for attempt in (first, resumed):
        load = {m["rank"]: m for m in of_type(attempt, "memory") if m["phase"] == "load"}
        assert load[0]["weights_read_mb"] > 0
        assert load[1]["weights_read_mb"] == 0  # built without weights; rank 0 broadcast its shard
        (started,) = of_type(attempt, "started")
        assert started["fsdp_unsharded_params"] == 0
    assert_same_adapter(job / "adapter", ddp_run / "adapter")


def test_dora_under_fsdp2_matches_ddp(tiny_causal_lm: Path, tmp_path: Path) -> None:
    dora = {"use_dora": True}
    ddp = lora_job(tmp_path / "ddp", tiny_causal_lm, DDP, peft=dora, max_steps=4)
    sharded = lora_job(tmp_path / "fsdp", tiny_causal_lm, fsdp(), peft=dora, max_steps=4)
    launch(ddp)
    launch(sharded)
    names = set(adapter(sharded / "adapter"))
    assert any("lora_magnitude_vector" in n for n in names)  # DoRA's extra tensors too
    assert_same_adapter(sharded / "adapter", ddp / "adapter")
