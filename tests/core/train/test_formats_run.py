"""Every file format trains end to end: CSV, a JSON array, Parquet and a directory mixing
JSONL, CSV and Parquet, each through the real trainer on a tiny model."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.utils.jobdirs import events, make_job, of_type
from tests.utils.tiny import chat_rows, classification_rows, text_rows, write_jsonl


def _csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            # CSV cells are text: a chat's messages go in as JSON.
            w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _point_at(job: Path, train: Path, eval_path: Path | None = None) -> None:
    body = json.loads((job / "spec.json").read_text())
    body["spec"]["dataset"]["path"] = str(train)
    body["runtime"]["train_path"] = str(train)
    if eval_path is not None:
        body["runtime"]["eval_path"] = str(eval_path)
    (job / "spec.json").write_text(json.dumps(body))


def _losses(job: Path) -> list[float]:
    return [e["loss"] for e in of_type(events(job), "progress") if "loss" in e]


def test_chat_from_csv(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    rows = chat_rows(32)
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        rows,
        spec={
            "dataset": {"format": "chat"},
            "training": {"max_steps": 8, "logging_steps": 1, "learning_rate": 2e-2},
        },
    )
    _point_at(job, _csv(tmp_path / "data" / "chat.csv", rows))
    assert run_main(job) == 0
    (started,) = of_type(events(job), "started")
    assert (started["rows"], started["examples"], started["truncated"]) == (32, 32, 0)
    # Assistant turns only, and at least the answer and its EOS in every row.
    assert started["loss_tokens"] >= 2 * 32 and started["tokens"] > started["loss_tokens"]
    losses = _losses(job)
    assert losses[-1] < losses[0]


def test_chat_from_a_json_array(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    """One JSON array of objects (what datasets.load_dataset("json") reads), not lines."""
    rows = chat_rows(24, seed=3)
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        rows[:1],
        spec={"dataset": {"format": "chat"}, "training": {"max_steps": 3, "logging_steps": 1}},
    )
    array = tmp_path / "data" / "chat.json"
    array.parent.mkdir(parents=True, exist_ok=True)
    array.write_text(json.dumps(rows, indent=1))
    _point_at(job, array)
    assert run_main(job) == 0
    (started,) = of_type(events(job), "started")
    assert started["rows"] == started["examples"] == 24
    assert (job / "adapter" / "adapter_model.safetensors").is_file()


def test_text_from_a_directory_of_jsonl_csv_and_parquet(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    rows = text_rows(48, seed=8)
    rows[40] = {"text": " ".join(["the big red dog runs"] * 40)}  # past max_seq_length 64
    job = make_job(tmp_path, tiny_causal_lm, rows[:1], spec={"training": {"max_steps": 3}})
    data = tmp_path / "data" / "mixed"
    write_jsonl(data / "a.jsonl", rows[:16])
    _csv(data / "b.csv", rows[16:32])
    _parquet(data / "c.parquet", rows[32:])
    _point_at(job, data)
    assert run_main(job) == 0
    (started,) = of_type(events(job), "started")
    assert started["rows"] == started["examples"] == 48
    assert started["truncated"] == 1 and 48 * 4 < started["tokens"] <= 48 * 64
    assert (job / "adapter" / "adapter_model.safetensors").is_file()


def test_classification_from_parquet_with_class_weights_and_merged_export(
    tiny_seq_cls: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    """seq_cls from Parquet: labels mapped to ids and saved, class weights, accuracy and
    macro-F1 in the eval event, and the merged export carrying id2label."""
    train, ev = classification_rows(64), classification_rows(16, seed=9)
    job = make_job(
        tmp_path,
        tiny_seq_cls,
        train,
        spec={
            "model": {"task": "seq_cls"},
            "dataset": {"format": "classification"},
            "training": {
                "learning_rate": 1e-2,
                "class_weights": {"negative": 2.0, "positive": 1.0},
                "export_merged": True,
            },
        },
    )
    _point_at(
        job,
        _parquet(tmp_path / "data" / "train.parquet", train),
        _parquet(tmp_path / "data" / "eval.parquet", ev),
    )
    assert run_main(job) == 0
    evs = events(job)
    (e,) = of_type(evs, "eval")
    assert 0.0 <= e["accuracy"] <= 1.0 and 0.0 <= e["f1"] <= 1.0
    assert [s["path"] for s in of_type(evs, "saved")] == ["adapter", "merged"]
    assert [m["phase"] for m in of_type(evs, "memory")][-1] == "merge"

    id2label = {"0": "negative", "1": "positive"}
    labels = json.loads((job / "adapter" / "labels.json").read_text())
    assert labels["id2label"] == id2label
    card = (job / "adapter" / "README.md").read_text()
    assert "| 0 | negative |" in card and "| 1 | positive |" in card

    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    merged = AutoModelForSequenceClassification.from_pretrained(job / "merged").eval()
    assert merged.config.id2label == {0: "negative", 1: "positive"}
    # The adapter loads with the saved labels, as its model card says.
    base = AutoModelForSequenceClassification.from_pretrained(
        tiny_seq_cls,
        num_labels=labels["num_labels"],
        id2label={int(k): v for k, v in labels["id2label"].items()},
        label2id=labels["label2id"],
    )
    adapted = PeftModel.from_pretrained(base, job / "adapter").eval()
    assert adapted.config.id2label == merged.config.id2label
    tok = AutoTokenizer.from_pretrained(job / "merged")
    batch = dict(tok(["the happy cat runs", "a sad dog"], return_tensors="pt", padding=True))
    with torch.no_grad():
        assert torch.allclose(merged(**batch).logits, adapted(**batch).logits, atol=1e-5)
