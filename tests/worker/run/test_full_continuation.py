"""model.from_job for a full fine-tune, through the worker and the real trainer: the new job
starts from the source's weights at a checkpoint (checkpoint-N/model), or from its final
model (no step), on another process count and strategy. Every row is the same sentence, so
every batch is the same: the continued job's first loss (computed before its first update)
is the source's loss at the step after that checkpoint, or the source's evaluation loss on
that sentence after its last step; starting from the base would give the source's first
loss instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.db.models import JobStatus
from core.run.jobdir import JobDir
from tests.utils.specs import spec_body
from tests.utils.tiny import write_jsonl
from tests.utils.worker import WorkerEnv, events_of, get_job, make_job, make_tenant

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]  # multi-process runs

ROWS = [{"text": "the quick brown fox jumps over the lazy dog"}] * 16


def spec(base: Path, data: Path, **sections: object) -> dict[str, object]:
    """A full fine-tune's spec; ``sections`` replace whole sections."""
    return spec_body(
        base, task="causal_lm",
        dataset={"path": str(data), "format": "text", "max_seq_length": 32},
        peft={"method": "full"},
        training={"max_steps": 4, "learning_rate": 1e-3, "per_device_train_batch_size": 4,
                  "logging_steps": 1, "save_steps": 2, "seed": 0},
    ) | sections


def losses(job_id: str) -> dict[int, float]:
    return {e.data["step"]: e.data["loss"] for e in events_of(job_id, "progress")
            if "loss" in e.data}


def continue_from(w: WorkerEnv, base: Path, data: Path, tenant: str, source: str,
                  model: dict[str, object], distributed: dict[str, object]
                  ) -> tuple[str, JobDir, dict[str, object]]:
    """Run a one-step full fine-tune from ``source`` (``model``: from_job and maybe step) on
    2 processes of 2 rows: the same global batch of identical rows. Its id, folder and
    started event."""
    from worker.run.local import run_job

    job_id = make_job(
        spec(base, data,
             model={"name_or_path": str(base), "task": "causal_lm", "from_job": source,
                    **model},
             training={"max_steps": 1, "learning_rate": 1e-3, "per_device_train_batch_size": 2,
                       "logging_steps": 1, "save_steps": 100, "seed": 0},
             distributed=distributed),
        tenant_id=tenant,
    )
    result = run_job(job_id)
    jd = JobDir(w.settings.jobs_dir / job_id)
    assert result == JobStatus.succeeded, (get_job(job_id).error_message,
                                           jd.log.read_text()[-3000:])
    (started,) = [e.data for e in events_of(job_id, "started")]
    return job_id, jd, started


def test_a_full_job_continues_from_another_full_jobs_checkpoint_on_two_processes(
        tiny_tied_causal_lm: Path, tmp_path: Path, configure, sqlite_url: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from worker.run.local import run_job

    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_tied_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train")
    data = write_jsonl(w.data_root / "train.jsonl", ROWS)
    tenant = make_tenant()
    source = make_job(spec(tiny_tied_causal_lm, data), tenant_id=tenant)
    assert run_job(source) == JobStatus.succeeded, get_job(source).error_message
    trained = losses(source)
    assert trained[3] < trained[1]  # it learned: starting over would not give step 3's loss

    job_id, jd, started = continue_from(w, tiny_tied_causal_lm, data, tenant, source,
                                        {"step": 2}, {"strategy": "ddp", "num_processes": 2})
    assert started["initialized_from"] == {"job": source, "step": 2}
    assert (started["initial_step"], started["world_size"]) == (0, 2)  # a new job, its own steps
    assert losses(job_id)[1] == pytest.approx(trained[3], rel=1e-5)
    # It trained from those weights: its model moved away from them.
    start = AutoModelForCausalLM.from_pretrained(
        w.settings.jobs_dir / source / "checkpoints" / "checkpoint-2" / "model")
    end = load_file(str(next((jd.root / "model").glob("model-00001-*.safetensors"))))
    name = next(iter(end))
    assert not torch.equal(end[name], start.state_dict()[name])


def test_a_full_job_continues_from_another_full_jobs_final_model_under_fsdp2(
        tiny_tied_causal_lm: Path, tmp_path: Path, configure, sqlite_url: str) -> None:
    """The source trains on one process (strategy none) and evaluates the same sentence after
    its last step: the loss its final weights give. The new job names no step, so it starts
    from the final model (the job's model/, not a checkpoint), under FSDP2 on 2 processes."""
    from safetensors.torch import load_file

    from worker.run.local import run_job

    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_tied_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train", FTUNE_CPU_FSDP2="1")
    data = write_jsonl(w.data_root / "train.jsonl", ROWS)
    tenant = make_tenant()
    source = make_job(
        spec(tiny_tied_causal_lm, data,
             dataset={"path": str(data), "eval_path": str(data), "format": "text",
                      "max_seq_length": 32},
             training={"max_steps": 3, "learning_rate": 1e-3, "per_device_train_batch_size": 4,
                       "logging_steps": 1, "save_steps": 100, "eval_steps": 3, "seed": 0}),
        tenant_id=tenant)
    assert run_job(source) == JobStatus.succeeded, get_job(source).error_message
    trained = losses(source)
    (final_eval,) = [e.data for e in events_of(source, "eval") if e.data["step"] == 3]
    # It learned: the final weights are not the base's (nor the first step's).
    assert final_eval["eval_loss"] < trained[1]

    job_id, jd, started = continue_from(
        w, tiny_tied_causal_lm, data, tenant, source, {},
        {"strategy": "fsdp", "num_processes": 2,
         "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD"}})
    assert started["initialized_from"] == {"job": source, "step": None}
    assert (started["initial_step"], started["world_size"]) == (0, 2)
    assert started["distributed_type"] == "FSDP"
    # Its first loss, before its first update, is what the source's final weights give.
    assert losses(job_id)[1] == pytest.approx(final_eval["eval_loss"], rel=1e-4)
    # And it trained from them: its model moved away from the source's final model.
    start = load_file(str(next((w.settings.jobs_dir / source / "model").glob("*.safetensors"))))
    end = load_file(str(next((jd.root / "model").glob("*.safetensors"))))
    name = next(iter(end))
    assert not torch.equal(end[name], start[name])


def test_a_job_of_another_tenant_cannot_be_continued_even_by_the_worker(
        tiny_tied_causal_lm: Path, tmp_path: Path, configure, sqlite_url: str) -> None:
    """The worker finds the source again at claim, within the job's own tenant."""
    from worker.run.local import run_job

    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_tied_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train")
    data = write_jsonl(w.data_root / "train.jsonl", ROWS)
    source = make_job(spec(tiny_tied_causal_lm, data), status=JobStatus.succeeded)
    job_id = make_job(spec(tiny_tied_causal_lm, data,
                           model={"name_or_path": str(tiny_tied_causal_lm),
                                  "task": "causal_lm", "from_job": source}))
    assert run_job(job_id) == JobStatus.failed
    job = get_job(job_id)
    assert job.error_code == "invalid_spec"
    assert f"job {source} not found" in (job.error_message or "")
