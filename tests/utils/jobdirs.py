"""Job directories for trainer tests: spec.json written by hand, as the worker would, and
launched as the worker does (testkit/launch.py, shared with bench/sharding_runs.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from core.run.jobdir import read_events
from testkit.launch import (  # the tests import them from here
    REPO_ROOT,
    trainer_env,
    write_launch_files,
)
from testkit.wait import wait_until
from tests.utils.tiny import write_jsonl

# Whether DeepSpeed runs can launch here (the deepspeed extra is installed).
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_job(
    root: Path,
    model_path: Path | str,
    rows: list[dict[str, Any]],
    *,
    spec: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    eval_rows: list[dict[str, Any]] | None = None,
) -> Path:
    """A job dir under ``root`` with train.jsonl and a spec for a short CPU run.

    ``spec`` / ``runtime`` are deep-merged over small defaults (few steps, tiny batches).
    """
    job = root / "job"
    job.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(root / "data" / "train.jsonl", rows)
    base_spec: dict[str, Any] = {
        "model": {"name_or_path": str(model_path), "task": "causal_lm"},
        "dataset": {"path": str(train), "format": "text", "max_seq_length": 64},
        "peft": {"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "training": {
            "max_steps": 6,
            "learning_rate": 5e-3,
            "per_device_train_batch_size": 4,
            "logging_steps": 2,
            "save_steps": 3,
            "seed": 0,
        },
    }
    base_runtime: dict[str, Any] = {
        "job_id": "job-test",
        "attempt": 1,
        "model_path": str(model_path),
        "train_path": str(train),
        "eval_path": None,
        "resume_from_checkpoint": None,
        "device": "cpu",
        "allow_trust_remote_code": False,
        "deadline": None,
    }
    if eval_rows is not None:
        base_runtime["eval_path"] = str(write_jsonl(root / "data" / "eval.jsonl", eval_rows))
    merged = _merge(base_spec, spec or {})
    peft = (spec or {}).get("peft") or {}
    if peft.get("method", "lora") != "lora":
        merged["peft"] = peft  # another method: the LoRA defaults would be unknown fields
    body = {
        "spec": merged,
        "runtime": _merge(base_runtime, runtime or {}),
    }
    (job / "spec.json").write_text(json.dumps(body, indent=2))
    return job


def run_trainer(job: Path, *, timeout: float = 180, extra_env: dict[str, str] | None = None):
    """``python -m core.train <job>`` in a subprocess; returns CompletedProcess."""
    env = trainer_env()
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "core.train", str(job)],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def events(job: Path) -> list[dict[str, Any]]:
    return [e for _, e in read_events(job / "events.jsonl")]


def of_type(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["type"] == kind]


def set_runtime(job: Path, **runtime: Any) -> None:
    """Change runtime fields of spec.json (e.g. the next attempt's resume checkpoint)."""
    body = json.loads((job / "spec.json").read_text())
    body["runtime"].update(runtime)
    (job / "spec.json").write_text(json.dumps(body, indent=2))


def launch(job: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``accelerate launch`` of core.train on ``job`` as the worker starts it; must exit 0."""
    argv, env = write_launch_files(job)
    proc = subprocess.run(
        argv, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def launch_and_stop(job: Path, at_step: int, log: Path, timeout: float = 300) -> int:
    """Launch, write STOP (as the worker does for a graceful stop) once step ``at_step`` was
    logged, wait for a clean exit; returns the step the run stopped at."""

    argv, env = write_launch_files(job)
    with log.open("w") as out:  # a file, as the worker does: a pipe nobody reads could block
        proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_until(lambda: [e for e in events(job)
                                if e["type"] == "progress" and e["step"] >= at_step],
                       timeout, f"step {at_step}", every=0.02,
                       give_up=lambda: proc.poll() is not None and log.read_text()[-4000:])
            (job / "STOP").touch()
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, log.read_text()[-4000:]
    (stopped,) = of_type(events(job), "stopped")
    return int(stopped["step"])


def losses(evs: list[dict[str, Any]]) -> dict[int, float]:
    """Logged training loss by step."""
    return {e["step"]: e["loss"] for e in of_type(evs, "progress") if "loss" in e}


def resume(job: Path, checkpoint: Path) -> list[dict[str, Any]]:
    """Launch attempt 2 of a stopped job from ``checkpoint`` (as the worker does after a
    requeue); returns the events this attempt wrote."""
    (job / "STOP").unlink(missing_ok=True)
    set_runtime(job, attempt=2, resume_from_checkpoint=str(checkpoint))
    n_before = len(events(job))
    launch(job)
    return events(job)[n_before:]


def model_weights(model_dir: Path) -> dict[str, Any]:
    """Every tensor of a saved full model (safetensors shards + index), by name."""
    from safetensors.torch import load_file

    from core.train.full_model import INDEX_FILE

    index = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
    out: dict[str, Any] = {}
    for name in sorted(set(index.values())):
        out.update(load_file(str(model_dir / name)))
    return out


def read_error(job: Path) -> dict[str, Any]:
    """The error.json the trainer wrote when it failed (the worker's account of why)."""
    return json.loads((job / "error.json").read_text())
