"""DeepSpeed checkpoints that travel (core/train/deepspeed_checkpoint.py), on real runs of a
tiny Llama: ZeRO-3 with parameters and optimizer offloaded to the CPU, 2 processes -> 1 for
a LoRA adapter and for full fine-tuning, and 1 -> 2 for full fine-tuning.

A ZeRO checkpoint holds flat per-rank partitions; the resumed run converts it to DeepSpeed's
universal checkpoint and the engine reads its own slices of that. It keeps the checkpoint's
global batch (per-device batch x accumulation x processes), so its steps continue the same
data. What it must match is an uninterrupted run: its losses from the resumed step on, and
its final weights. For full fine-tuning that run is on the new process count (each count's
run is also the other test's checkpoint); for LoRA it is the 2-process run the checkpoint
came from, which one process with the same global batch must continue to float rounding
(what a 1-process LoRA run of its own added was its steps 1-4 alike, at one more launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.utils.adapters import assert_loads, assert_same_adapter
from tests.utils.deepspeed_runs import FULL, LORA, SAVED, STEPS, checkpoint, run
from tests.utils.jobdirs import events, losses, of_type

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    # The first DeepSpeed test on a machine also waits for the cpu_adam build (conftest.py).
    pytest.mark.timeout(1800),
]


# The 2-process LoRA run is tests/utils/deepspeed_runs.py's, shared with test_deepspeed_runs.py.
@pytest.fixture(scope="module")
def lora_two(zero3_lora_two: Path) -> Path:
    return zero3_lora_two


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
    lora_two: Path, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    """One process with the same global batch continues the 2-process run exactly."""
    ckpt = checkpoint(lora_two)
    job = run(tmp_path, tiny_causal_lm, 1, LORA, resume=ckpt)
    assert_continues(job, lora_two, {"from": 2, "to": 1})
    (started,) = of_type(events(job), "started")
    assert started["gradient_accumulation_steps"] == 2
    # Only the adapter went through the conversion: the frozen base is read again.
    names = universal_params(ckpt)
    assert names and all("lora_" in n for n in names)
    assert_same_adapter(job / "adapter", lora_two / "adapter")


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
