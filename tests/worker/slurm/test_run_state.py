"""Where a watched SLURM job's state comes from (worker/slurm/run.py ``SlurmRun.state``):
the controller while it knows the job; after it forgot it, a final state from accounting
or the batch script's exit file; else nothing (no guess). SLURM's commands are replaced
by what they would answer; the choice between their answers is what is tested."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from core.infra.settings import Settings
from core.policy import pool_from_settings
from core.spec import JobSpec
from worker.run.claim import Claim
from worker.slurm import commands, script
from worker.slurm.commands import SlurmJob
from worker.slurm.run import SlurmRun

SPEC = {"model": {"name_or_path": "org/model"}, "dataset": {"file_id": "file-x", "format": "text"},
        "distributed": {"strategy": "ddp", "num_processes": 2, "num_machines": 2}}


@pytest.fixture
def run(tmp_path: Path) -> SlurmRun:
    settings = Settings(data_dir=tmp_path, slurm_partition="debug", slurm_max_nodes=2,
                        slurm_shared_root=tmp_path / "shared")  # type: ignore[call-arg]
    pool = pool_from_settings(settings)
    assert pool is not None
    r = SlurmRun(Claim("job_x", "ten_x", "w1", 1, JobSpec.model_validate(SPEC),
                           datetime.now(UTC)), settings, pool)
    r.jd.root.mkdir(parents=True)
    r.slurm_job_id = "7"
    return r


def answers(monkeypatch: pytest.MonkeyPatch, squeue: SlurmJob | None,
            sacct: SlurmJob | None) -> None:
    monkeypatch.setattr(commands, "find", lambda job_id: squeue)
    monkeypatch.setattr(commands, "sacct_state", lambda job_id: sacct)


def test_the_controllers_word_first(run: SlurmRun, monkeypatch: pytest.MonkeyPatch) -> None:
    answers(monkeypatch, SlurmJob("7", "n", "RUNNING"), SlurmJob("7", "n", "FAILED"))
    assert run.state() == SlurmJob("7", "n", "RUNNING")


def test_a_forgotten_job_ends_as_accounting_says(run: SlurmRun,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    answers(monkeypatch, None, SlurmJob("7", "n", "PREEMPTED"))
    (run.jd.root / script.EXIT_FILE).write_text(json.dumps({"returncode": 0,
                                                            "slurm_job_id": "7"}))
    assert run.state() == SlurmJob("7", "n", "PREEMPTED")


def test_a_forgotten_job_is_not_running_whatever_accounting_says(
        run: SlurmRun, monkeypatch: pytest.MonkeyPatch) -> None:
    answers(monkeypatch, None, SlurmJob("7", "n", "RUNNING"))
    assert run.state() is None


def test_without_accounting_the_exit_file_of_this_slurm_job(
        run: SlurmRun, monkeypatch: pytest.MonkeyPatch) -> None:
    answers(monkeypatch, None, None)
    exit_file = run.jd.root / script.EXIT_FILE
    exit_file.write_text(json.dumps({"returncode": 1, "slurm_job_id": "6"}))  # an earlier one
    assert run.state() is None
    exit_file.write_text(json.dumps({"returncode": 1, "slurm_job_id": "7"}))
    assert run.state() == SlurmJob("7", "", "FAILED", exit_code=1)
