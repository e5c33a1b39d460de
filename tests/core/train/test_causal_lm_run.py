"""The trainer end to end as the worker runs it: ``python -m core.train <job_dir>``, one
process, a tiny Llama, causal_lm on text. One run (module fixture), several checks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.jobdirs import events, make_job, of_type, run_trainer
from tests.utils.tiny import sentences

STEPS = 30


@pytest.fixture(scope="module")
def run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Few distinct sentences, repeated: learnable in a few dozen steps by a rank-8 adapter.
    rows = [{"text": s} for s in sentences(4, seed=7)] * 16
    job = make_job(
        tmp_path_factory.mktemp("causal"),
        tiny_causal_lm,
        rows,
        spec={
            "peft": {"target_modules": "all-linear", "r": 8, "lora_alpha": 16},
            "training": {
                "max_steps": STEPS,
                "learning_rate": 2e-2,
                "per_device_train_batch_size": 8,
                "logging_steps": 5,
                "save_steps": 15,
            },
        },
    )
    proc = run_trainer(job)
    return {"job": job, "proc": proc, "events": events(job)}


def test_exits_zero_without_error_json(run: dict[str, Any]) -> None:
    proc: subprocess.CompletedProcess[str] = run["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run["job"] / "error.json").exists()


def test_started_event_describes_the_run(run: dict[str, Any]) -> None:
    (started,) = of_type(run["events"], "started")
    assert started["world_size"] == 1
    assert started["strategy"] == "none"
    assert started["distributed_type"] == "NO"
    assert started["total_steps"] == STEPS
    assert started["rows"] == 64 and started["examples"] == 64
    assert started["tokens"] > 64 and started["truncated"] == 0
    assert 0 < started["trainable_params"] < started["total_params"]
    # Every position of a text row carries a loss: nothing for the fused head to skip.
    assert started["lm_head"].startswith("plain (dataset.format text")


def test_progress_every_step_with_loss_at_logging_steps(run: dict[str, Any]) -> None:
    progress = of_type(run["events"], "progress")
    assert [e["step"] for e in progress] == list(range(1, STEPS + 1))
    logged = [e for e in progress if "loss" in e]
    assert [e["step"] for e in logged] == [1, 5, 10, 15, 20, 25, 30]
    for e in logged:
        assert e["learning_rate"] > 0 and e["grad_norm"] > 0
        assert e["tokens_per_second"] > 0 and e["total_steps"] == STEPS


def test_checkpoint_events_point_at_saved_checkpoints(run: dict[str, Any]) -> None:
    checkpoints = of_type(run["events"], "checkpoint")
    assert [c["step"] for c in checkpoints] == [15, 30]
    for c in checkpoints:
        assert c["path"] == f"checkpoints/checkpoint-{c['step']}"
        assert (run["job"] / c["path"] / "adapter_model.safetensors").is_file()
        assert "loss" in c["metrics"]


def test_memory_finished_and_saved_events(run: dict[str, Any]) -> None:
    evs = run["events"]
    assert [m["phase"] for m in of_type(evs, "memory")] == ["load", "train", "save"]
    assert all(m["cpu_mb_peak"] >= m["cpu_mb_begin"] > 0 for m in of_type(evs, "memory"))
    (saved,) = of_type(evs, "saved")
    assert saved["path"] == "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(saved["files"])
    assert "tokenizer.json" in saved["files"]
    (finished,) = of_type(evs, "finished")
    assert finished["step"] == STEPS and finished["train_loss"] > 0
    assert evs[-1]["type"] == "finished"


def test_loss_falls(run: dict[str, Any]) -> None:
    losses = [e["loss"] for e in of_type(run["events"], "progress") if "loss" in e]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses


def test_adapter_dir_is_final_and_clean(run: dict[str, Any]) -> None:
    job = run["job"]
    assert not (job / "adapter.tmp").exists()
    files = {p.name for p in (job / "adapter").iterdir()}
    assert "training_args.bin" not in files
    config = json.loads((job / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    card = (job / "adapter" / "README.md").read_text()
    assert "PeftModel.from_pretrained" in card and "training rows | 64" in card


def test_adapter_loads_and_changes_logits(run: dict[str, Any], tiny_causal_lm: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run["job"] / "adapter")
    inputs = tok(["the cat sees the dog"], return_tensors="pt")
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm).eval()
    with torch.no_grad():
        before = base(**inputs).logits
    model = PeftModel.from_pretrained(base, run["job"] / "adapter").eval()
    with torch.no_grad():
        after = model(**inputs).logits
    assert (after - before).abs().max() > 1e-3
