"""DeepSpeed checkpoints that travel (core/train/deepspeed_checkpoint.py), on real runs of a
tiny Llama: ZeRO-3 with parameters and optimizer offloaded to the CPU, 2 processes -> 1 for
a LoRA adapter and for full fine-tuning, and 1 -> 2 for full fine-tuning.

A ZeRO checkpoint holds flat per-rank partitions; the resumed run converts it to DeepSpeed's
universal checkpoint and the engine reads its own slices of that. It keeps the checkpoint's
global batch (per-device batch x accumulation x processes), so its steps continue the same
data. What it must match is an uninterrupted run on the new process count: its losses from
the resumed step on, and its final weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.adapters import assert_loads, assert_same_adapter
from tests.utils.jobdirs import events, launch, losses, make_job, of_type
from tests.utils.tiny import text_rows

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    # The first DeepSpeed test on a machine also waits for the cpu_adam build (conftest.py).
    pytest.mark.timeout(1800),
]

STEPS, SAVED = 8, 4
Z3_CPU = {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}
LORA: dict[str, Any] = {}  # make_job's LoRA
FULL = {"method": "full"}


def ds_job(
    root: Path, model: Path, processes: int, peft: dict[str, Any], resume: Path | None = None
) -> Path:
    # A global batch of 4: 2 per device on 2 processes, or 2 x 2 accumulated on one. A resumed
    # job keeps the training section of the run that wrote the checkpoint (on the other
    # count), as the scheduler's resize (distributed.resume_on) does: the trainer finds the
    # accumulation that keeps the global batch, and DeepSpeed must follow it.
    on_one = processes == 1 if resume is None else processes != 1
    per_rank = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2 if on_one else 1}
    return make_job(
        root,
        model,
        text_rows(64),
        spec={
            "peft": peft,
            "training": {"max_steps": STEPS, "save_steps": SAVED, "logging_steps": 1,
                         "learning_rate": 1e-3, **per_rank},
            "distributed": {"strategy": "deepspeed", "num_processes": processes,
                            "deepspeed": Z3_CPU},
        },
        runtime={"resume_from_checkpoint": str(resume) if resume else None},
    )


def checkpoint(job: Path, step: int = SAVED) -> Path:
    return job / "checkpoints" / f"checkpoint-{step}"


def run(root: Path, model: Path, processes: int, peft: dict[str, Any],
        resume: Path | None = None) -> Path:
    job = ds_job(root, model, processes, peft, resume)
    launch(job, timeout=900)
    return job


@pytest.fixture(scope="module")
def lora_two(cpu_adam: float, tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Path:
    return run(tmp_path_factory.mktemp("lora-two"), tiny_causal_lm, 2, LORA)


@pytest.fixture(scope="module")
def lora_one(cpu_adam: float, tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Path:
    return run(tmp_path_factory.mktemp("lora-one"), tiny_causal_lm, 1, LORA)


@pytest.fixture(scope="module")
def full_two(cpu_adam: float, tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Path:
    return run(tmp_path_factory.mktemp("full-two"), tiny_causal_lm, 2, FULL)


@pytest.fixture(scope="module")
def full_one(cpu_adam: float, tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Path:
    return run(tmp_path_factory.mktemp("full-one"), tiny_causal_lm, 1, FULL)


def assert_continues(resumed: Path, uninterrupted: Path, world: dict[str, int]) -> None:
    """The resumed run went through the universal checkpoint, logs steps SAVED+1.. with the
    uninterrupted run's losses, and says the world size changed."""
    evs = events(resumed)
    (started,) = of_type(evs, "started")
    assert started["initial_step"] == SAVED
    assert started["resumed_world_size"] == world
    assert started["resumed_strategy"] == {"from": "deepspeed", "to": "deepspeed"}
    assert started["rebatched"]["global_batch"] == 4
    assert started["universal_checkpoint_seconds"] is not None
    assert (started["zero_stage"], started["offload_optimizer_device"]) == (3, "cpu")
    want, got = losses(events(uninterrupted)), losses(evs)
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def universal_params(ckpt: Path) -> set[str]:
    """The parameters in the checkpoint's universal copy (one folder each)."""
    tag = (ckpt / "latest_universal").read_text().strip()
    zero = ckpt / tag / "zero"
    return {p.name for p in zero.iterdir() if p.is_dir()}


def model_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index.values())):
        out.update(load_file(str(model_dir / name)))
    return out


def assert_same_model(a: Path, b: Path) -> None:
    x, y = model_weights(a), model_weights(b)
    assert x and set(x) == set(y)
    for name in x:
        torch.testing.assert_close(x[name], y[name], rtol=1e-5, atol=1e-6, msg=name)


def test_one_and_two_processes_train_alike_with_the_same_global_batch(
    lora_one: Path, lora_two: Path
) -> None:
    want, got = losses(events(lora_two)), losses(events(lora_one))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_a_zero3_lora_checkpoint_downloads_as_an_adapter(
    lora_two: Path, tiny_causal_lm: Path
) -> None:
    """The checkpoint's adapter (what GET /v1/jobs/{id}/adapter?checkpoint=4 serves) loads,
    and holds the values DeepSpeed's own fp32 reconstruction of the partitions has."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from peft.utils import load_peft_weights

    ckpt = checkpoint(lora_two)
    assert_loads(tiny_causal_lm, ckpt)
    saved = load_peft_weights(str(ckpt), device="cpu")
    zero = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    lora = {k.replace(".default.", "."): v for k, v in zero.items() if "lora_" in k}
    assert saved and set(saved) == set(lora)
    for name, t in saved.items():
        assert torch.equal(t, lora[name].to(t.dtype)), name


def test_a_zero3_lora_checkpoint_resumes_on_one_process(
    lora_two: Path, lora_one: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    ckpt = checkpoint(lora_two)
    job = run(tmp_path, tiny_causal_lm, 1, LORA, resume=ckpt)
    assert_continues(job, lora_one, {"from": 2, "to": 1})
    (started,) = of_type(events(job), "started")
    assert started["gradient_accumulation_steps"] == 2
    # Only the adapter went through the conversion: the frozen base is read again.
    names = universal_params(ckpt)
    assert names and all("lora_" in n for n in names)
    assert_same_adapter(job / "adapter", lora_one / "adapter")


def test_a_zero3_full_checkpoint_resumes_on_one_process(
    full_two: Path, full_one: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    ckpt = checkpoint(full_two)
    # An intermediate save of a full model gathers nothing on rank 0: the engine's
    # partitions (one file per rank) are the training state, and the downloadable model/
    # beside it was written by the rank owning each file, one parameter gathered at a time.
    assert not list(ckpt.glob("*.safetensors")) and not list(ckpt.glob("*.bin"))
    assert len(list((ckpt / f"global_step{SAVED}").glob("*optim_states.pt"))) == 2
    assert (ckpt / "model" / "files.json").is_file()
    job = run(tmp_path, tiny_causal_lm, 1, FULL, resume=ckpt)
    assert_continues(job, full_one, {"from": 2, "to": 1})
    assert any("embed_tokens" in n for n in universal_params(ckpt))
    assert_same_model(job / "model", full_one / "model")


def test_a_one_process_zero3_full_checkpoint_resumes_on_two(
    full_one: Path, full_two: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    job = run(tmp_path, tiny_causal_lm, 2, FULL, resume=checkpoint(full_one))
    assert_continues(job, full_two, {"from": 1, "to": 2})
    (started,) = of_type(events(job), "started")
    assert started["gradient_accumulation_steps"] == 1
    assert_same_model(job / "model", full_two / "model")
