"""A GRPO run's graders run beside the trainer, in the worker's grading process: the trainer
sends answers over a unix socket, one batch per round trip, and holds no secret it does not
need (the judge endpoint's key is in the grading process's environment, not in the trainer's
environment nor in its job directory). The real trainer, launched by run_job."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from core.db.models import JobStatus
from core.run.jobdir import JobDir
from testkit.wait import wait_until
from tests.utils.tiny import sentences, write_jsonl
from tests.utils.worker import WorkerEnv, get_job, make_job
from worker.run import process_tree
from worker.run.local import run_job

pytestmark = pytest.mark.slow

KEY = "sk-judge-" + "7f3a9c" * 4
LENGTH = "def grade(sample, item):\n    return min(1.0, len(sample['output_text']) / 20)\n"


def environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def _grpo_job(w: WorkerEnv, model: Path, name: str, *, rows_seed: int, max_steps: int,
              save_steps: int) -> str:
    """A GRPO LoRA job graded by the sandboxed python length grader, on 16 chat prompts."""
    rows = [{"messages": [{"role": "user", "content": s}]} for s in sentences(16, rows_seed)]
    data = write_jsonl(w.data_root / "prompts.jsonl", rows)
    return make_job({
        "name": name,
        "model": {"name_or_path": str(model), "task": "causal_lm"},
        "dataset": {"path": str(data), "format": "chat", "max_seq_length": 64},
        "peft": {"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "training": {"objective": "grpo", "max_steps": max_steps,
                     "per_device_train_batch_size": 8, "logging_steps": 1,
                     "save_steps": save_steps, "seed": 0,
                     "grpo": {"grader": {"type": "python", "name": "length", "source": LENGTH},
                              "num_generations": 4, "max_completion_length": 8}},
    })


def test_the_trainer_grades_through_the_grading_process_and_holds_no_judge_key(
        tiny_causal_lm: Path, tmp_path: Path, configure: Any, sqlite_url: str) -> None:
    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train", FTUNE_PYTHON_GRADERS="true",
                             FTUNE_GRADER_JUDGE_API_KEY=KEY)
    job_id = _grpo_job(w, tiny_causal_lm, "grpo", rows_seed=7, max_steps=6, save_steps=100)
    jd = JobDir(w.settings.jobs_dir / job_id)
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(run_job(job_id)))
    t.start()
    try:
        wait_until(lambda: get_job(job_id).step >= 1 or not t.is_alive(), 300,
                   "a first GRPO step")
        procs = process_tree.tagged_prefix(f"{job_id}:")
        cmdlines = {p.pid: " ".join(p.cmdline()) for p in procs if p.is_running()}
        trainers = [pid for pid, c in cmdlines.items() if "core.train" in c]
        graders = [pid for pid, c in cmdlines.items() if "core.run.grading_process" in c]
        assert trainers and graders, cmdlines
        for pid in trainers:  # the launcher and its rank
            assert KEY.encode() not in environ(pid)
            assert b"FTUNE_GRADING_SOCKET=" in environ(pid)
        assert f"FTUNE_GRADER_JUDGE_API_KEY={KEY}".encode() in environ(graders[0])
    finally:
        t.join(timeout=600)
    job = get_job(job_id)
    assert result == [JobStatus.succeeded], (job.error_code, job.error_message)
    for path in jd.root.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    assert process_tree.tagged_prefix(f"{job_id}:") == set()  # the grading process too
    assert not [p for p in psutil.process_iter(["cmdline"])
                if jd.spec.as_posix() in " ".join(p.info["cmdline"] or [])]


def test_a_killed_grpo_run_resumes_from_its_checkpoint_and_its_rewards_go_on(
        tiny_causal_lm: Path, tmp_path: Path, configure: Any, sqlite_url: str) -> None:
    import os
    import signal

    from core.run.checkpoints import Manifest
    from tests.utils.worker import events_of, statuses

    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train", FTUNE_PYTHON_GRADERS="true")
    job_id = _grpo_job(w, tiny_causal_lm, "grpo-resume", rows_seed=8, max_steps=8,
                       save_steps=2)
    jd = JobDir(w.settings.jobs_dir / job_id)
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(run_job(job_id)))
    t.start()
    try:
        wait_until(lambda: jd.latest_checkpoint() is not None or not t.is_alive(), 300,
                   "a first checkpoint")
        # The rank: the trainer's process under the `accelerate launch` launcher.
        ranks = [p.pid for p in process_tree.tagged_prefix(f"{job_id}:")
                 if "core.train" in (c := " ".join(p.cmdline())) and "accelerate" not in c]
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
    finally:
        t.join(timeout=600)
    assert result == [JobStatus.queued], get_job(job_id).error_message
    checkpoint = jd.latest_checkpoint()
    assert checkpoint is not None
    manifest = Manifest.read(checkpoint)  # ftune's own format, as the other objectives
    assert manifest is not None and manifest.trainable == "adapter"
    assert (checkpoint / "adapter_model.safetensors").exists()
    resumed_at = manifest.step

    assert run_job(job_id) == JobStatus.succeeded, get_job(job_id).error_message
    started = events_of(job_id, "started")
    assert started[-1].data["resumed_from"] == f"checkpoints/{checkpoint.name}"
    rewards = {e.data["step"] for e in events_of(job_id, "progress") if "reward" in e.data}
    assert set(range(resumed_at + 1, 9)) <= rewards  # the rewards go on after the resume
    assert statuses(job_id) == ["running", "queued", "running", "succeeded"]
