"""dataset.packing end to end: rows and steps known up front, real tokens counted, and the
trainer's own path (collator -> JobTrainer -> model) keeps examples apart."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from tests.utils.jobdirs import events, make_job, of_type
from tests.utils.tiny import text_rows

EPOCHS = 3
BATCH = 32  # more than the packed rows: one step sees the whole data set


def test_packed_run(tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]) -> None:
    rows = text_rows(64, seed=21)
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        rows,
        spec={
            "dataset": {"packing": True, "max_seq_length": 64},
            "training": {
                "max_steps": -1,
                "num_train_epochs": EPOCHS,
                "per_device_train_batch_size": BATCH,
                "logging_steps": 1,
                "learning_rate": 1e-2,
            },
        },
    )
    assert run_main(job) == 0
    evs = events(job)
    (started,) = of_type(evs, "started")
    assert started["packing"] == "mask" and started["attn_implementation"] == "sdpa"
    assert started["examples"] == 64 and 0 < started["packed_rows"] < 64 / 3
    # Known before the first step: packed rows / batch, per epoch.
    assert started["total_steps"] == EPOCHS * math.ceil(started["packed_rows"] / BATCH) == EPOCHS
    progress = of_type(evs, "progress")
    assert [e["step"] for e in progress] == [1, 2, 3]
    # Only real tokens are counted (no padding of the packed rows).
    assert progress[-1]["tokens_seen"] == EPOCHS * started["tokens"]

    # LoRA starts as a no-op (B = 0), so the first step's loss is the base model's loss on
    # the whole data set. Packed correctly, that is the mean over every token predicted
    # within its own example, computed here one example at a time.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([tok(r["text"])["input_ids"] + [tok.eos_token_id]])
            total += float(base(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    # (Measured: 4e-8 here; letting the examples see each other makes it 8.5e-4.)
    assert abs(progress[0]["loss"] - total / count) < 1e-5, (progress[0]["loss"], total / count)
    assert progress[-1]["loss"] < progress[0]["loss"]
    assert (job / "adapter" / "adapter_model.safetensors").is_file()
