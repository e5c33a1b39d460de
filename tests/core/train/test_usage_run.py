"""What a real run reports for usage: the trainer's token counts equal a count made here with
the model's tokenizer, and the dry run's estimate (core/data/counts.py) predicts them. One run
of the tiny Llama, prompt_completion (so loss tokens differ from input tokens), 2 epochs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.data.counts import count_tokens, optimizer_steps
from core.spec import parse_job_spec
from tests.utils.jobdirs import events, make_job, of_type, run_trainer
from tests.utils.tiny import sentences

EPOCHS = 2
BATCH = 4


@pytest.fixture(scope="module")
def run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    texts = sentences(20, seed=3)
    rows = [{"prompt": texts[i], "completion": texts[i + 10]} for i in range(10)]
    job = make_job(
        tmp_path_factory.mktemp("usage"),
        tiny_causal_lm,
        rows,
        spec={
            "dataset": {"format": "prompt_completion", "max_seq_length": 256},
            "training": {
                "max_steps": -1,
                "num_train_epochs": EPOCHS,
                "per_device_train_batch_size": BATCH,
                "save_steps": 1000,
            },
        },
    )
    proc = run_trainer(job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"job": job, "rows": rows, "events": events(job)}


def _independent_counts(model: Path, rows: list[dict[str, str]]) -> tuple[int, int]:
    """(input tokens, loss tokens) of one epoch: prompt with the tokenizer's special tokens,
    completion without, plus EOS; the loss covers the completion and its EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tokens = loss = 0
    for r in rows:
        prompt = tok(r["prompt"])["input_ids"]
        completion = tok(r["completion"], add_special_tokens=False)["input_ids"]
        if not completion or completion[-1] != tok.eos_token_id:
            completion = [*completion, tok.eos_token_id]
        tokens += len(prompt) + len(completion)
        loss += len(completion)
    return tokens, loss


def test_trained_tokens_equal_an_independent_count(
    run: dict[str, Any], tiny_causal_lm: Path
) -> None:
    tokens, loss = _independent_counts(tiny_causal_lm, run["rows"])
    assert loss < tokens
    (finished,) = of_type(run["events"], "finished")
    assert finished["tokens_trained"] == EPOCHS * tokens
    assert finished["loss_tokens_trained"] == EPOCHS * loss
    last = of_type(run["events"], "progress")[-1]
    assert (last["tokens_trained"], last["loss_tokens_trained"]) == (EPOCHS * tokens, EPOCHS * loss)


def test_completion_loss_ran_on_the_fused_head(run: dict[str, Any]) -> None:
    # The token counts above were made on this path: the LM head only at loss positions.
    (started,) = of_type(run["events"], "started")
    assert started["lm_head"] == "fused"


def test_the_estimate_predicts_tokens_and_steps(run: dict[str, Any], tiny_causal_lm: Path) -> None:
    import json

    body = json.loads((run["job"] / "spec.json").read_text())
    spec = parse_job_spec(body["spec"])
    count = count_tokens(spec, str(tiny_causal_lm), Path(body["runtime"]["train_path"]), None)
    steps, per_epoch = optimizer_steps(count.batch_rows, spec)
    (started,) = of_type(run["events"], "started")
    (finished,) = of_type(run["events"], "finished")
    assert steps == started["total_steps"] == finished["step"] == EPOCHS * per_epoch == 6
    assert count.tokens * EPOCHS == finished["tokens_trained"]
    assert count.loss_tokens * EPOCHS == finished["loss_tokens_trained"]


def test_started_event_and_model_card_name_the_resolved_target_modules(
    run: dict[str, Any],
) -> None:
    (started,) = of_type(run["events"], "started")
    # The spec left target_modules to peft's default for Llama.
    assert started["target_modules"] == ["q_proj", "v_proj"]
    card = (run["job"] / "adapter" / "README.md").read_text()
    assert "target_modules=['q_proj', 'v_proj']" in card
    assert "total steps" in card
