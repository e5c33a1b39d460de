"""Which executor runs a claimed job (worker/run/executor.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from core.infra.settings import Settings
from core.spec import JobSpec, stored_spec_error
from worker.run.claim import Claim
from worker.run.executor import executor_for
from worker.run.local import JobRun
from worker.slurm.run import SlurmRun


def claim(**dist: object) -> Claim:
    spec = {"model": {"name_or_path": "org/model"},
            "dataset": {"file_id": "file-x", "format": "text"}, "distributed": dist}
    return Claim("job_x", "ten_x", "w1", 1, JobSpec.model_validate(spec), datetime.now(UTC))


def settings(tmp: Path, **over: object) -> Settings:
    return Settings(data_dir=tmp, **over)  # type: ignore[arg-type]


def test_without_a_pool_everything_runs_here(tmp_path: Path) -> None:
    run = executor_for(claim(strategy="ddp", num_processes=2, num_machines=2),
                       settings(tmp_path))
    assert type(run) is JobRun  # and the local run refuses it, naming num_machines


def test_a_slurm_worker_sends_multi_machine_jobs_to_slurm(tmp_path: Path) -> None:
    s = settings(tmp_path, slurm_partition="debug", slurm_max_nodes=2,
                 slurm_shared_root=tmp_path / "shared")
    run = executor_for(claim(strategy="ddp", num_processes=2, num_machines=2), s)
    assert isinstance(run, SlurmRun) and run.jd.root == tmp_path / "shared" / "job_x"
    assert type(executor_for(claim(strategy="ddp", num_processes=2), s)) is JobRun


def test_single_machine_jobs_go_to_slurm_when_the_operator_says_so(tmp_path: Path) -> None:
    s = settings(tmp_path, slurm_partition="debug", slurm_single_node=True)
    assert isinstance(executor_for(claim(), s), SlurmRun)


def test_a_spec_that_does_not_parse_runs_here_to_be_refused(tmp_path: Path) -> None:
    s = settings(tmp_path, slurm_partition="debug")
    bad = Claim("job_x", "ten_x", "w1", 1, None, datetime.now(UTC),
                spec_error=stored_spec_error({"model": {}}))
    assert type(executor_for(bad, s)) is JobRun
