"""Preference tuning for real (TRL 1.16) on the tiny Llama, one process, in this process.

* DPO: the adapter loads with PeftModel.from_pretrained and, on the training pairs, its
  (chosen - rejected) log-probability margin is larger than the base model's: the direction
  of the preference was learned, not only "the loss fell". Its rewards reach the events;
  a run resumed from its checkpoint continues the same loss curve.
* ORPO (chat prompts rendered with the template) and KTO (unpaired rows) train and write
  adapters that load on the base.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.jobdirs import events, losses, make_job, of_type, set_runtime
from tests.utils.tiny import kto_rows, preference_rows

REWARDS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def preference_job(root: Path, model_dir: Path, rows: list[dict[str, Any]], **spec: Any) -> Path:
    training = {
        "max_steps": 6,
        "logging_steps": 1,
        "save_steps": 3,
        "learning_rate": 1e-2,
        **spec.pop("training", {}),
    }
    return make_job(root, model_dir, rows, spec={"training": training, **spec})


def run(job: Path) -> Path:
    import signal

    from core.train.__main__ import main

    previous = signal.getsignal(signal.SIGTERM)  # main installs its own
    try:
        assert main([str(job)]) == 0, (job / "error.json").read_text()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return job


@pytest.fixture(scope="module")
def dpo_run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run(
        preference_job(
            tmp_path_factory.mktemp("dpo"),
            tiny_causal_lm,
            preference_rows(40),
            dataset={"format": "preference", "eval_split": 0.2},
            training={"objective": "dpo", "eval_steps": 3, "preference": {"beta": 0.1}},
        )
    )


def answer_logps(model: Any, tok: Any, prompt: str, answer: str) -> float:
    """Sum of log p(answer tokens | prompt), as DPO scores an answer."""
    p = tok(prompt)["input_ids"]
    full = tok(prompt + answer)["input_ids"]
    ids = torch.tensor([full])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    targets = ids[0, 1:]
    picked = logp.gather(1, targets[:, None])[:, 0]
    return float(picked[len(p) - 1 :].sum())


def mean_margin(model: Any, tok: Any, rows: list[dict[str, Any]]) -> float:
    margins = [
        answer_logps(model, tok, r["prompt"], r["chosen"])
        - answer_logps(model, tok, r["prompt"], r["rejected"])
        for r in rows
    ]
    return sum(margins) / len(margins)


def test_dpo_adapter_prefers_the_chosen_answers_more_than_the_base(
    dpo_run: Path, tiny_causal_lm: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    rows = preference_rows(40)
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm).eval()
    before = mean_margin(base, tok, rows)
    tuned = PeftModel.from_pretrained(base, dpo_run / "adapter").eval()
    after = mean_margin(tuned, tok, rows)
    assert after > before + 0.5, (before, after)
    # One adapter, the trained one: no copy of it as a "ref" adapter was saved.
    assert not (dpo_run / "adapter" / "ref").exists()
    assert list(tuned.peft_config) == ["default"]


def test_dpo_rewards_reach_progress_and_eval_events(dpo_run: Path) -> None:
    evs = events(dpo_run)
    (started,) = of_type(evs, "started")
    assert (started["objective"], started["rows"], started["examples"]) == ("dpo", 32, 32)
    assert started["lm_head"] == "fused"
    assert started["tokens"] > 0
    progress = [e for e in of_type(evs, "progress") if "loss" in e]
    assert [e["step"] for e in progress] == [1, 2, 3, 4, 5, 6]
    assert all(k in e for e in progress for k in REWARDS)
    # The adapter starts as the identity, so the first step's policy equals the reference.
    assert progress[0]["reward_margin"] == 0.0 and progress[0]["loss"] == pytest.approx(0.6931, 1e-3)
    assert progress[-1]["reward_margin"] > 0 and progress[-1]["reward_accuracy"] > 0.5
    evals = of_type(evs, "eval")
    assert [e["step"] for e in evals] == [3, 6]
    assert all(k in e for e in evals for k in REWARDS)
    assert evals[-1]["reward_margin"] > 0
    assert of_type(evs, "finished")[0]["step"] == 6


def test_dpo_counts_the_tokens_it_trained(dpo_run: Path) -> None:
    assert_trained_tokens_counted(dpo_run)


def test_dpo_resumes_from_its_checkpoint_on_the_same_curve(dpo_run: Path, tmp_path: Path) -> None:
    job = tmp_path / "job"
    shutil.copytree(dpo_run, job)
    (job / "events.jsonl").unlink()
    shutil.rmtree(job / "adapter")
    body = (job / "spec.json").read_text().replace(str(dpo_run), str(job))
    (job / "spec.json").write_text(body)
    set_runtime(job, attempt=2, resume_from_checkpoint=str(job / "checkpoints" / "checkpoint-3"))
    run(job)
    want, got = losses(events(dpo_run)), losses(events(job))
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


@pytest.mark.parametrize(
    ("objective", "rows", "extra"),
    [
        # ORPO on chat prompts: TRL renders them with the tokenizer's chat template.
        ("orpo", lambda: preference_rows(16, chat=True), {}),
        ("kto", lambda: kto_rows(16), {"preference": {"desirable_weight": 1.5}}),
    ],
)
def test_orpo_and_kto_train_loadable_adapters(
    objective: str,
    rows: Callable[[], list[dict[str, Any]]],
    extra: dict[str, Any],
    tiny_causal_lm: Path,
    tmp_path: Path,
) -> None:
    from peft import PeftModel
    from peft.utils import load_peft_weights
    from transformers import AutoModelForCausalLM

    job = run(
        preference_job(
            tmp_path,
            tiny_causal_lm,
            rows(),
            dataset={"format": "kto" if objective == "kto" else "preference"},
            training={"objective": objective, "max_steps": 3, "save_steps": 10, **extra},
        )
    )
    weights = load_peft_weights(str(job / "adapter"), device="cpu")
    assert any(bool(t.any()) for n, t in weights.items() if "lora_B" in n)  # it trained
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_causal_lm), job / "adapter")
    progress = [e for e in of_type(events(job), "progress") if "loss" in e]
    assert len(progress) == 3 and all("reward_margin" in e for e in progress)
    if objective == "kto":
        assert all("kl" in e for e in progress)
    # ORPO's batches hold no input_ids for the Trainer to count: counted by ftune instead.
    assert progress[-1]["tokens_per_second"] > 0
    assert_trained_tokens_counted(job)


def assert_trained_tokens_counted(job: Path) -> None:
    """The usage of a preference run: its input tokens, and among them the completion
    tokens the loss is made of (the prompts carry none)."""
    (finished,) = of_type(events(job), "finished")
    tokens, loss_tokens = finished["tokens_trained"], finished["loss_tokens_trained"]
    assert 0 < loss_tokens < tokens, (tokens, loss_tokens)


def test_dpo_on_a_4bit_base_trains_a_float32_adapter(tiny_causal_lm: Path, tmp_path: Path) -> None:
    from peft.utils import load_peft_weights

    job = run(
        preference_job(
            tmp_path,
            tiny_causal_lm,
            preference_rows(8),
            model={"quantization": {"load_in": "4bit", "quant_type": "nf4"}},
            dataset={"format": "preference"},
            training={"objective": "dpo", "max_steps": 2, "save_steps": 10},
        )
    )
    (started,) = of_type(events(job), "started")
    assert (started["objective"], started["quantization"]) == ("dpo", "4bit")
    weights = load_peft_weights(str(job / "adapter"), device="cpu")
    # TRL would train a quantized model's adapter in bfloat16; ftune keeps float32.
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    assert any(bool(t.any()) for n, t in weights.items() if "lora_B" in n)
