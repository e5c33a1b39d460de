"""Submitting while the SLURM controller does not answer (worker/slurm/run.py
``SlurmRun.sbatch_when_answered``): the run retries with backoff, says why it waits, honours
a cancel meanwhile, and fails with slurm_unavailable only after
FTUNE_SLURM_SUBMIT_RETRY_SECONDS. SLURM's commands are small scripts first on PATH that
answer as sbatch and squeue do while slurmctld is down, then as they do once it is back."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from core.db.models import JobStatus, utcnow
from core.infra.errors import ErrorCode
from core.policy import pool_from_settings
from core.spec import JobSpec
from testkit.wait import wait_until
from tests.utils.threads import Background
from tests.utils.worker import WorkerEnv, events_of, get_job, make_job, request_cancel
from worker.run.claim import Claim
from worker.slurm.run import SlurmRun

SPEC = {"model": {"name_or_path": "org/model"}, "dataset": {"file_id": "file-x", "format": "text"},
        "distributed": {"strategy": "ddp", "num_processes": 2, "num_machines": 2}}
DOWN = "Unable to contact slurm controller (connect failure)"
# squeue fails while the file `down` holds a positive count (one less per call); sbatch
# fails while `sbatch_down` exists. Each command logs its calls.
SQUEUE = f"""#!/bin/sh
echo squeue >> "$FAKE_SLURM/calls"
n=$(cat "$FAKE_SLURM/down" 2>/dev/null || echo 0)
if [ "$n" -gt 0 ]; then
  echo $((n - 1)) > "$FAKE_SLURM/down"
  echo "slurm_load_jobs error: {DOWN}" >&2
  exit 1
fi
echo '{{"jobs": []}}'
"""
SBATCH = f"""#!/bin/sh
echo sbatch >> "$FAKE_SLURM/calls"
if [ -e "$FAKE_SLURM/sbatch_down" ]; then
  echo "sbatch: error: Batch job submission failed: {DOWN}" >&2
  exit 1
fi
echo 4242
"""


@pytest.fixture
def slurm(tmp_path: Path, sqlite_url: str, configure: Callable[..., WorkerEnv],
          monkeypatch: pytest.MonkeyPatch) -> Path:
    configure(tmp_path, sqlite_url, FTUNE_SLURM_PARTITION="debug", FTUNE_SLURM_MAX_NODES="2",
              FTUNE_SLURM_POLL_SECONDS="0.02", FTUNE_SLURM_SUBMIT_RETRY_SECONDS="30")
    fake = tmp_path / "fake-slurm"
    fake.mkdir()
    for name, text in (("squeue", SQUEUE), ("sbatch", SBATCH)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    monkeypatch.setenv("FAKE_SLURM", str(fake))
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return fake


def slurm_run(**settings: object) -> SlurmRun:
    from core.infra.settings import get_settings

    s = get_settings().model_copy(update=settings)
    job_id = make_job(SPEC, status=JobStatus.running, worker_id="w1", attempt=1,
                      started_at=utcnow())
    pool = pool_from_settings(s)
    assert pool is not None
    run = SlurmRun(Claim(job_id, get_job(job_id).tenant_id, "w1", 1,
                         JobSpec.model_validate(SPEC), datetime.now(UTC)), s, pool)
    run.jd.root.mkdir(parents=True)
    return run


def submit(run: SlurmRun) -> tuple[str | None, str | None]:
    return run.sbatch_when_answered(f"ftune-{run.job_id}-a1", ["sbatch", "--parsable", "x"],
                                    dict(os.environ))


def test_a_controller_back_after_two_tries_gets_the_job(slurm: Path) -> None:
    (slurm / "down").write_text("2")
    run = slurm_run()
    assert submit(run) == ("4242", None)
    waits = [e for e in events_of(run.job_id, "slurm") if "not answering" in e.message]
    assert [e.data["tries"] for e in waits] == [1, 2]
    assert [e.data["retry_in_seconds"] for e in waits] == [0.02, 0.04]  # backoff doubles
    assert DOWN in waits[0].message
    assert get_job(run.job_id).waiting_for is None  # no longer waiting
    assert (slurm / "calls").read_text().split() == ["squeue"] * 3 + ["sbatch"]


def test_a_controller_that_never_answers_fails_the_job_slurm_unavailable(slurm: Path) -> None:
    (slurm / "sbatch_down").touch()
    run = slurm_run(slurm_submit_retry_seconds=0.1)
    slurm_id, outcome = submit(run)
    assert slurm_id is None and outcome == JobStatus.failed
    job = get_job(run.job_id)
    assert job.error_code == ErrorCode.slurm_unavailable
    assert "FTUNE_SLURM_SUBMIT_RETRY_SECONDS" in (job.error_message or "")
    assert DOWN in (job.error_message or "")


def test_while_it_waits_the_job_says_why_and_a_cancel_ends_it(slurm: Path) -> None:
    (slurm / "down").write_text("1000000")
    run = slurm_run()
    waiter = Background(lambda: submit(run))
    try:
        why = wait_until(lambda: get_job(run.job_id).waiting_for, 20, "the job to say why",
                         every=0.01)
        assert why.startswith("SLURM controller not answering")
    finally:
        request_cancel(run.job_id)
    assert waiter.join(60) == (None, JobStatus.cancelled)
    assert get_job(run.job_id).status == JobStatus.cancelled
    assert "sbatch" not in (slurm / "calls").read_text().split()
