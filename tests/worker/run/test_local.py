"""run_job called directly (as a Celery worker would, eagerly) with the fake trainer: each
outcome of a run, and the refusals before any process starts. Tests about the launch and the
process tree run it under a real `accelerate launch`; the others (``direct``) skip it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from core.db.models import Eval, EvalRun, JobStatus, utcnow
from core.db.session import session_scope
from core.evals.job_results import artifact_kept
from core.jobs.state import RunOutcome
from core.run.jobdir import JobDir
from core.run.plan import RunPlan
from tests.utils.threads import act_when
from tests.utils.worker import (
    WorkerEnv,
    events_of,
    fake_job,
    get_job,
    request_cancel,
    set_job,
    statuses,
)
from worker.run import process_tree
from worker.run.local import run_job


def assert_no_process_left(job_id: str, jd: JobDir) -> None:
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
    pids = json.loads((jd.root / "pids.json").read_text())
    assert pids["trainer"]
    for pid in [pids["trainer"], *pids["tree"]]:
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_success_records_adapter_progress_and_checkpoints(wenv: WorkerEnv) -> None:
    job_id = fake_job(wenv, "succeed")

    assert run_job(job_id) == JobStatus.succeeded

    job = get_job(job_id)
    jd = JobDir(wenv.settings.jobs_dir / job_id)
    assert job.status == JobStatus.succeeded
    assert job.adapter_path == str(jd.adapter)
    assert (job.attempt, job.step, job.total_steps) == (1, 4, 4)
    assert job.train_loss == 0.25 and job.peak_memory_mb == 123.0
    assert job.training_started_at is not None and job.finished_at is not None
    assert job.launch is not None and job.launch["argv"][-2:] == ["testkit.fake_trainer",
                                                                  str(jd.root)]
    assert "accelerate.commands.launch" in job.launch["argv"]
    assert json.loads(jd.launch.read_text())["accelerate_yaml"] == jd.accelerate_config.read_text()
    runtime = RunPlan.read(jd.spec).runtime  # the trainer's own reader accepts it
    assert runtime.device == "cpu" and runtime.attempt == 1
    assert runtime.resume_from_checkpoint is None
    assert statuses(job_id) == ["running", "succeeded"]
    assert [e.data["step"] for e in events_of(job_id, "progress")] == [1, 2, 3, 4]
    assert job.events_offset == jd.events.stat().st_size
    assert_no_process_left(job_id, jd)


def test_duplicate_delivery_is_skipped(wenv: WorkerEnv, direct: None) -> None:
    job_id = fake_job(wenv, "succeed")
    assert run_job(job_id) == JobStatus.succeeded

    assert run_job(job_id) == RunOutcome.skipped
    assert get_job(job_id).attempt == 1


def test_crash_reports_error_json_and_log_tail(wenv: WorkerEnv, direct: None) -> None:
    job_id = fake_job(wenv, "crash")

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert (job.error_code, job.error_message) == ("out_of_memory", "ran out of memory")
    tail = [e for e in events_of(job_id, "log") if "trainer.log" in e.message]
    assert tail and any("CUDA out of memory" in line for line in tail[0].data["lines"])
    assert "OutOfMemoryError" in tail[0].data["traceback"]


def test_crash_without_error_json_is_trainer_crashed_with_log(wenv: WorkerEnv,
                                                              direct: None) -> None:
    job_id = fake_job(wenv, "crash_raw")

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "trainer_crashed"
    assert "ValueError: something broke" in (job.error_message or "")


def test_exit_zero_without_adapter_fails(wenv: WorkerEnv, direct: None) -> None:
    job_id = fake_job(wenv, "no_adapter")

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "trainer_crashed"
    assert (job.error_message or "").startswith("trainer exited 0 without an adapter")


def test_adapter_with_no_weights_is_invalid(wenv: WorkerEnv, direct: None) -> None:
    job_id = fake_job(wenv, "empty")

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "adapter_invalid"
    assert "empty tensors" in (job.error_message or "")
    assert job.adapter_path is None


def test_cancel_stops_the_whole_tree(wenv: WorkerEnv) -> None:
    job_id = fake_job(wenv, "slow")
    jd = JobDir(wenv.settings.jobs_dir / job_id)

    def training() -> bool:
        job = get_job(job_id)
        return job.status == JobStatus.running and job.step >= 3 and \
            (jd.root / "grandchildren.txt").exists()

    t = act_when(training, lambda _: request_cancel(job_id), 60, "the tree to train",
                 every=0.1)
    result = run_job(job_id)
    t.join()

    assert result == JobStatus.cancelled
    assert get_job(job_id).status == JobStatus.cancelled
    assert jd.stop.exists()
    assert events_of(job_id, "stopped"), "the trainer was asked to stop gracefully first"
    assert_no_process_left(job_id, jd)


def test_stubborn_trainer_is_killed_after_grace(wenv: WorkerEnv, direct: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTUNE_CANCEL_GRACE_SECONDS", "1")
    wenv.reload()
    job_id = fake_job(wenv, "stubborn")
    jd = JobDir(wenv.settings.jobs_dir / job_id)

    t = act_when(lambda: get_job(job_id).step >= 2, lambda _: request_cancel(job_id), 60,
                 "step 2", every=0.1)
    started = time.monotonic()
    assert run_job(job_id) == JobStatus.cancelled
    t.join()
    assert time.monotonic() - started < 30
    assert not events_of(job_id, "stopped")
    assert_no_process_left(job_id, jd)


def test_worker_error_kills_the_tree_and_fails_internal(wenv: WorkerEnv, direct: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.run.watch

    job_id = fake_job(wenv, "slow")
    jd = JobDir(wenv.settings.jobs_dir / job_id)
    real_ingest = worker.run.watch.ingest_events

    def ingest_then_break(session, job_id, job_dir, **kw):  # type: ignore[no-untyped-def]
        n = real_ingest(session, job_id, job_dir, **kw)
        if (jd.root / "grandchildren.txt").exists() and get_job(job_id).step >= 2:
            raise RuntimeError("boom")
        return n

    monkeypatch.setattr(worker.run.watch, "ingest_events", ingest_then_break)

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert (job.error_code, job.error_message) == ("internal", "worker error: RuntimeError: boom")
    assert_no_process_left(job_id, jd)


def test_timeout_fails_with_timeout(wenv: WorkerEnv, direct: None) -> None:
    job_id = fake_job(wenv, "slow", resources={"timeout_seconds": 6})
    jd = JobDir(wenv.settings.jobs_dir / job_id)

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "timeout"
    assert "6 s" in (job.error_message or "")
    assert job.step > 0, "the trainer ran until the deadline"
    assert_no_process_left(job_id, jd)


def test_second_attempt_resumes_from_latest_checkpoint(wenv: WorkerEnv, direct: None) -> None:
    job_id = fake_job(wenv, "succeed")
    jd = JobDir(wenv.settings.jobs_dir / job_id)
    for step in (2, 4):
        (jd.checkpoints / f"checkpoint-{step}").mkdir(parents=True)
        (jd.checkpoints / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (jd.checkpoints / "checkpoint-6").mkdir()  # incomplete: no trainer_state.json
    jd.stop.touch()  # left by the previous attempt; must not stop this one
    set_job(job_id, attempt=1, started_at=utcnow())

    assert run_job(job_id) == JobStatus.succeeded

    runtime = RunPlan.read(jd.spec).runtime
    assert runtime.attempt == 2
    assert runtime.resume_from_checkpoint == jd.checkpoints / "checkpoint-4"


def test_out_of_attempts_fails_worker_lost(wenv: WorkerEnv) -> None:
    job_id = fake_job(wenv, "succeed")
    set_job(job_id, attempt=wenv.settings.max_attempts)

    assert run_job(job_id) == RunOutcome.skipped

    job = get_job(job_id)
    assert (job.status, job.error_code) == (JobStatus.failed, "worker_lost")


def test_cpu_worker_refuses_fsdp(wenv: WorkerEnv) -> None:
    job_id = fake_job(wenv, "succeed", distributed={"strategy": "fsdp", "num_processes": 2})

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "unsupported_hardware"
    assert "GPU" in (job.error_message or "")
    assert statuses(job_id) == ["running", "failed"]
    assert not (wenv.settings.jobs_dir / job_id / "trainer.log").exists()


def test_cpu_worker_refuses_bf16(wenv: WorkerEnv) -> None:
    job_id = fake_job(wenv, "succeed", training={"mixed_precision": "bf16"})

    assert run_job(job_id) == JobStatus.failed
    assert get_job(job_id).error_code == "unsupported_hardware"


def test_gpu_worker_refuses_more_processes_than_gpus(wenv: WorkerEnv,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTUNE_WORKER_GPUS", "2")
    wenv.reload()
    job_id = fake_job(wenv, "succeed", distributed={"strategy": "ddp", "num_processes": 4})

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "unsupported_hardware"
    assert "num_processes=4" in (job.error_message or "")


def test_dataset_of_another_tenant_is_refused(wenv: WorkerEnv) -> None:
    from tests.utils.worker import job_spec, make_file, make_job, make_tenant

    other = make_tenant()
    path = wenv.data_root / "theirs.jsonl"
    path.write_text('{"text": "a b c"}\n')
    file_id = make_file(other, path)
    job_id = make_job(job_spec(wenv.model_root, file_id=file_id))

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "invalid_dataset"
    assert file_id in (job.error_message or "")


def test_model_path_outside_allowed_roots_is_refused(wenv: WorkerEnv) -> None:
    from tests.utils.worker import job_spec, make_job

    data = wenv.data_root / "d.jsonl"
    data.write_text('{"text": "a b c"}\n')
    job_id = make_job(job_spec(wenv.tmp, path=data))  # tmp is not a model root

    assert run_job(job_id) == JobStatus.failed
    assert get_job(job_id).error_code == "model_not_found"


def test_a_failed_evaluation_fails_the_job_keeping_its_artifact(
        configure: Callable[..., WorkerEnv], tmp_path: Path, sqlite_url: str,
        direct: None) -> None:
    """No worker can run the engine here: the final model's eval run fails, and so does the
    job, saying which model and run; the verified adapter stays the job's to download."""
    wenv = configure(tmp_path, sqlite_url, FTUNE_ENGINE_VENV=str(tmp_path / "no-engine"))
    job_id = fake_job(wenv, "succeed")
    job = get_job(job_id)
    with session_scope() as s:
        ev = Eval(tenant_id=job.tenant_id, name="e", testing_criteria=[{
            "type": "string_check", "name": "any", "input": "{{sample.output_text}}",
            "reference": "", "operation": "like"}],
                  data_source_config={"type": "custom", "item_schema": {"type": "object"},
                                      "include_sample_schema": True})
        s.add(ev)
        s.flush()
        eval_id = ev.id
    set_job(job_id, spec={**job.spec, "evaluation": {"on": ["final"], "evals": [{
        "eval_id": eval_id, "source": {"type": "file_content", "content": [{"item": {}}]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "x"}]},
    }]}})

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "evaluation_failed" and job.error_message is not None
    assert job.error_message.startswith("the final model 'ft:") and "engine_unavailable" \
        not in job.error_message and "make engine" in job.error_message
    assert artifact_kept(job) and job.adapter_path == str(JobDir(
        wenv.settings.jobs_dir / job_id).adapter)
    assert job.evaluation is not None and job.evaluation["status"] == "failed"
    (score,) = job.evaluation["scores"]
    with session_scope() as s:
        run = s.get(EvalRun, score["run_id"])
        assert run is not None and (run.job_id, run.status, run.error_code) == (
            job_id, "failed", "engine_unavailable")
