"""A GRPO run's graders run beside the trainer, in the worker's grading process: the trainer
sends answers over a unix socket, one batch per round trip, and holds no secret it does not
need (the judge endpoint's key is in the grading process's environment, not in the trainer's
environment nor in its job directory). The real trainer, launched by run_job.

One run for the module (a GRPO run generates at every step: the slowest kind there is): its
rank is killed after its first checkpoint and run_job resumes it, so the key is looked for
in both attempts' processes and in every file either wrote."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from core.db.migrate import upgrade_head
from core.db.models import JobStatus
from core.run.checkpoints import Manifest
from core.run.jobdir import JobDir
from testkit.wait import wait_until
from tests.utils.tiny import sentences, write_jsonl
from tests.utils.worker import (
    configure_worker,
    events_of,
    get_job,
    make_job,
    statuses,
    teardown_worker,
)
from worker.run import process_tree
from worker.run.local import run_job

pytestmark = pytest.mark.slow

KEY = "sk-judge-" + "7f3a9c" * 4
# The sleep puts a floor of 0.4 s under each step (8 answers a step): on a quiet machine the
# 8 steps took 0.4 s in all, over before the test saw its first checkpoint to kill the rank.
LENGTH = ("import time\n\ndef grade(sample, item):\n    time.sleep(0.05)\n"
          "    return min(1.0, len(sample['output_text']) / 20)\n")
MAX_STEPS = 8


def environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


@dataclass
class GradedRun:
    job_id: str
    jd: JobDir
    trainer_environs: list[bytes]  # the launcher's and its rank's, while attempt 1 trained
    grader_environ: bytes
    first: str  # run_job's outcome for attempt 1 (its rank killed)
    checkpoint: Path  # the latest checkpoint once attempt 1 ended
    second: str  # for attempt 2, resumed


@pytest.fixture(scope="module")
def graded_run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[GradedRun]:
    """A GRPO LoRA job graded by the sandboxed python length grader on 16 chat prompts,
    a checkpoint every 2 steps: the processes' environments read once it trains, the rank
    SIGKILLed after the first checkpoint, then run_job again."""
    tmp = tmp_path_factory.mktemp("grading")
    db_url = f"sqlite:///{tmp / 'ftune.db'}"
    upgrade_head(db_url)
    with pytest.MonkeyPatch.context() as mp:
        w = configure_worker(mp, tmp, db_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train", FTUNE_PYTHON_GRADERS="true",
                             FTUNE_GRADER_JUDGE_API_KEY=KEY)
        try:
            rows = [{"messages": [{"role": "user", "content": s}]} for s in sentences(16, 7)]
            data = write_jsonl(w.data_root / "prompts.jsonl", rows)
            job_id = make_job({
                "name": "grpo",
                "model": {"name_or_path": str(tiny_causal_lm), "task": "causal_lm"},
                "dataset": {"path": str(data), "format": "chat", "max_seq_length": 64},
                "peft": {"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
                "training": {"objective": "grpo", "max_steps": MAX_STEPS,
                             "per_device_train_batch_size": 8, "logging_steps": 1,
                             "save_steps": 2, "seed": 0,
                             "grpo": {"grader": {"type": "python", "name": "length",
                                                 "source": LENGTH},
                                      "num_generations": 4, "max_completion_length": 8}},
            })
            jd = JobDir(w.settings.jobs_dir / job_id)
            result: list[str] = []
            t = threading.Thread(target=lambda: result.append(run_job(job_id)))
            t.start()
            try:
                wait_until(lambda: get_job(job_id).step >= 1 or not t.is_alive(), 300,
                           "a first GRPO step")
                procs = [p for p in process_tree.tagged_prefix(f"{job_id}:") if p.is_running()]
                cmdlines = {p.pid: " ".join(p.cmdline()) for p in procs}
                trainers = [pid for pid, c in cmdlines.items() if "core.train" in c]
                graders = [pid for pid, c in cmdlines.items()
                           if "core.run.grading_process" in c]
                assert trainers and graders, cmdlines
                trainer_environs = [environ(pid) for pid in trainers]
                grader_environ = environ(graders[0])
                wait_until(lambda: jd.latest_checkpoint() is not None or not t.is_alive(), 300,
                           "a first checkpoint")
                # The rank: the trainer's process under the `accelerate launch` launcher.
                ranks = [p.pid for p in process_tree.tagged_prefix(f"{job_id}:")
                         if "core.train" in (c := " ".join(p.cmdline())) and "accelerate" not in c]
                assert len(ranks) == 1, ranks
                os.kill(ranks[0], signal.SIGKILL)
            finally:
                t.join(timeout=600)
            checkpoint = jd.latest_checkpoint()
            assert result and checkpoint is not None, get_job(job_id).error_message
            yield GradedRun(job_id, jd, trainer_environs, grader_environ, result[0],
                            checkpoint, run_job(job_id))
        finally:
            teardown_worker()


def test_the_trainer_grades_through_the_grading_process_and_holds_no_judge_key(
        graded_run: GradedRun) -> None:
    run = graded_run
    for env in run.trainer_environs:  # the launcher and its rank
        assert KEY.encode() not in env
        assert b"FTUNE_GRADING_SOCKET=" in env
    assert f"FTUNE_GRADER_JUDGE_API_KEY={KEY}".encode() in run.grader_environ
    job = get_job(run.job_id)
    assert run.second == JobStatus.succeeded, (job.error_code, job.error_message)
    for path in run.jd.root.rglob("*"):  # what both attempts wrote
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    assert process_tree.tagged_prefix(f"{run.job_id}:") == set()  # the grading process too
    assert not [p for p in psutil.process_iter(["cmdline"])
                if run.jd.spec.as_posix() in " ".join(p.info["cmdline"] or [])]


def test_a_killed_grpo_run_resumes_from_its_checkpoint_and_its_rewards_go_on(
        graded_run: GradedRun) -> None:
    run = graded_run
    assert run.first == JobStatus.queued  # killed from outside: a system fault, requeued
    manifest = Manifest.read(run.checkpoint)  # ftune's own format, as the other objectives
    assert manifest is not None and manifest.trainable == "adapter"
    assert (run.checkpoint / "adapter_model.safetensors").exists()
    resumed_at = manifest.step

    assert run.second == JobStatus.succeeded, get_job(run.job_id).error_message
    started = events_of(run.job_id, "started")
    assert started[-1].data["resumed_from"] == f"checkpoints/{run.checkpoint.name}"
    rewards = {e.data["step"] for e in events_of(run.job_id, "progress") if "reward" in e.data}
    assert set(range(resumed_at + 1, MAX_STEPS + 1)) <= rewards  # the rewards go on
    assert statuses(run.job_id) == ["running", "queued", "running", "succeeded"]
