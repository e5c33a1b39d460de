"""Job specs for tests: the smallest body the parser accepts, and that body parsed.

A test names only the sections its scenario is about; the rest stays at the defaults the
parser fills in, so a default that changes shows up in the tests that depend on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.spec import JobSpec, parse_job_spec


def spec_body(model: str | Path | dict[str, Any] = "org/m", *, task: str | None = None,
              dataset: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    """A spec as a client sends it: ``model`` (a hub id or a local folder, or the whole
    model section), ``dataset`` (default: a local path, nothing uploaded) and whole
    ``sections`` (training, peft, distributed, ...) as given."""
    model_section = dict(model) if isinstance(model, dict) else {"name_or_path": str(model)}
    if task is not None:
        model_section["task"] = task
    return {"model": model_section, "dataset": dataset or {"path": "/d"}, **sections}


def parsed_spec(model: str | Path | dict[str, Any] = "org/m", *, task: str | None = None,
                dataset: dict[str, Any] | None = None, **sections: Any) -> JobSpec:
    """``spec_body`` through the parser's every check, as a submit runs them."""
    return parse_job_spec(spec_body(model, task=task, dataset=dataset, **sections))


def lm_spec(model: Path, file_id: str, **training: object) -> dict[str, Any]:
    """The stack tests' job: LoRA on a tiny causal LM over an uploaded text file, 8 steps,
    a checkpoint every 4; ``training`` fields over those."""
    return spec_body(
        model, task="causal_lm",
        dataset={"file_id": file_id, "format": "text", "max_seq_length": 48},
        peft={"method": "lora", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
        training={"max_steps": 8, "learning_rate": 3e-3, "per_device_train_batch_size": 4,
                  "logging_steps": 1, "save_steps": 4, **training},
    )


def grpo_spec(model: Path, dataset: dict[str, Any], grader: dict[str, Any],
              **training: object) -> dict[str, Any]:
    """A GRPO job: LoRA on a tiny causal LM over chat prompts (``dataset``: where they are),
    4 answers of at most 8 tokens per prompt scored by ``grader``, a batch of 8 answers,
    6 steps; ``training`` fields over those."""
    return spec_body(
        model, task="causal_lm", dataset={"format": "chat", "max_seq_length": 64, **dataset},
        peft={"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        training={"objective": "grpo", "max_steps": 6, "per_device_train_batch_size": 8,
                  "logging_steps": 1, "seed": 0,
                  "grpo": {"grader": grader, "num_generations": 4, "max_completion_length": 8},
                  **training},
    )
