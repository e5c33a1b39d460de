"""seq2seq_lm and seq_cls end to end (in-process: same code path as the CLI, no re-import)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.utils.jobdirs import events, make_job, of_type
from tests.utils.tiny import classification_rows, seq2seq_rows


def test_seq2seq_run_with_eval_split(
    tiny_seq2seq_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(
        tmp_path,
        tiny_seq2seq_lm,
        seq2seq_rows(),
        spec={
            "model": {"task": "seq2seq_lm"},
            "dataset": {"format": "seq2seq", "eval_split": 0.25},
            "training": {"eval_steps": 3},
        },
    )
    assert run_main(job) == 0
    evs = events(job)
    (started,) = of_type(evs, "started")
    assert (started["rows"], started["eval_rows"]) == (48, 16)
    evals = of_type(evs, "eval")
    assert [e["step"] for e in evals] == [3, 6]
    for e in evals:
        assert (
            e["eval_loss"] > 0 and abs(e["perplexity"] - torch.tensor(e["eval_loss"]).exp()) < 1e-3
        )
    config = json.loads((job / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_2_SEQ_LM"

    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    base = AutoModelForSeq2SeqLM.from_pretrained(tiny_seq2seq_lm)
    # Same alias the trainer (and the model card) apply for peft 0.21 + transformers 5.
    base._prepare_encoder_decoder_kwargs_for_generation = (
        base._prepare_text_encoder_decoder_kwargs_for_generation
    )
    PeftModel.from_pretrained(base, job / "adapter")


def test_seq_cls_run_saves_labels(
    tiny_seq_cls: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(
        tmp_path,
        tiny_seq_cls,
        classification_rows(),
        spec={
            "model": {"task": "seq_cls"},
            "dataset": {"format": "classification"},
            "training": {"learning_rate": 1e-2},
        },
        eval_rows=classification_rows(16, seed=9),
    )
    assert run_main(job) == 0
    evs = events(job)
    (ev,) = of_type(evs, "eval")  # no eval_steps: evaluated once, when training ends
    assert 0.0 <= ev["accuracy"] <= 1.0 and ev["eval_loss"] > 0
    labels = json.loads((job / "adapter" / "labels.json").read_text())
    assert labels["id2label"] == {"0": "negative", "1": "positive"}
    assert labels["label2id"] == {"negative": 0, "positive": 1}
    card = (job / "adapter" / "README.md").read_text()
    assert "| 1 | positive |" in card

    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(
        tiny_seq_cls, num_labels=2, id2label={0: "negative", 1: "positive"}
    )
    model = PeftModel.from_pretrained(base, job / "adapter").eval()
    # The classifier head trained with the adapter (modules_to_save) comes back with it.
    head = [n for n in model.state_dict() if "modules_to_save" in n]
    assert head, "the classification head was not saved with the adapter"
    with torch.no_grad():
        out = model(**_batch(base, job))
    assert out.logits.shape == (1, 2)


def _batch(model: torch.nn.Module, job: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(job / "adapter")
    return dict(tok(["the happy cat"], return_tensors="pt"))


def test_early_stopping_when_eval_loss_stops_improving(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    from tests.utils.tiny import text_rows

    # A learning rate so small that the adapter's update is below float32 resolution: the
    # eval loss repeats exactly, so it never improves after the first evaluation.
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(64),
        spec={
            "dataset": {"eval_split": 0.25},
            "training": {
                "max_steps": 20,
                "learning_rate": 1e-12,
                "eval_steps": 1,
                "early_stopping_patience": 2,
            },
        },
    )
    assert run_main(job) == 0
    evs = events(job)
    assert [e["step"] for e in of_type(evs, "eval")] == [1, 2, 3]
    (finished,) = of_type(evs, "finished")
    assert finished["early_stopped"] is True and finished["step"] == 3
    assert (job / "adapter").is_dir()


@pytest.mark.parametrize(
    "peft",
    [
        {"method": "lora", "use_dora": True, "use_rslora": True, "target_modules": "all-linear"},
        {"method": "ia3"},
        {"method": "prompt_tuning", "num_virtual_tokens": 4},
        {"method": "prefix_tuning", "num_virtual_tokens": 4},
    ],
    ids=lambda p: p["method"] + ("-dora" if p.get("use_dora") else ""),
)
def test_peft_methods_train_save_and_verify(
    peft: dict, tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    from tests.utils.tiny import chat_rows

    job = make_job(
        tmp_path,
        tiny_causal_lm,
        chat_rows(32),
        spec={"dataset": {"format": "chat"}, "training": {"max_steps": 3}},
    )
    body = json.loads((job / "spec.json").read_text())
    body["spec"]["peft"] = peft  # replace, not merge: each method has its own fields
    (job / "spec.json").write_text(json.dumps(body))
    assert run_main(job) == 0
    config = json.loads((job / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == peft["method"].upper()
    assert config["base_model_name_or_path"] == str(tiny_causal_lm)


@pytest.mark.parametrize("task", ["seq2seq_lm", "seq_cls"])
def test_full_fine_tuning_of_every_task_saves_a_loadable_model(
    task: str, tiny_seq2seq_lm: Path, tiny_seq_cls: Path, tmp_path: Path,
    run_main: Callable[[Path], int]
) -> None:
    """peft method full in one process (the 2-process strategies: test_full_runs.py)."""
    import transformers
    from safetensors.torch import load_file

    from core.spec import AUTO_MODEL_CLASS

    model, rows, fmt = {
        "seq2seq_lm": (tiny_seq2seq_lm, seq2seq_rows(16), "seq2seq"),
        "seq_cls": (tiny_seq_cls, classification_rows(16), "classification"),
    }[task]
    job = make_job(tmp_path, model, rows, spec={
        "model": {"task": task}, "dataset": {"format": fmt}, "peft": {"method": "full"},
        "training": {"max_steps": 2}})
    assert run_main(job) == 0
    assert not (job / "adapter").exists()
    saved = load_file(str(job / "model" / "model-00001-of-00001.safetensors"))
    loaded = getattr(transformers, AUTO_MODEL_CLASS[task]).from_pretrained(job / "model")
    for name, t in saved.items():
        assert torch.equal(loaded.state_dict()[name], t), name
    if task == "seq_cls":
        assert loaded.config.id2label == {0: "negative", 1: "positive"}
