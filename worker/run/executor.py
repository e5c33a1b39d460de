"""Which executor runs a claimed job: this worker's own processes (worker/run/local.py), or
the SLURM cluster it is configured for (worker/slurm/run.py) for jobs over several machines
(and single-machine ones too when the operator says so: FTUNE_SLURM_SINGLE_NODE)."""

from __future__ import annotations

from core.infra.settings import Settings
from core.policy import pool_from_settings, runs_on_slurm
from worker.run.claim import Claim
from worker.run.local import JobRun
from worker.run.local import run_job as _run_job


def executor_for(claim: Claim, settings: Settings) -> JobRun:
    pool = pool_from_settings(settings)
    # A spec that no longer parses (None) runs here, and the local run refuses it naming why.
    if pool is not None and claim.spec is not None and runs_on_slurm(claim.spec, pool):
        from worker.slurm.run import SlurmRun

        return SlurmRun(claim, settings, pool)
    return JobRun(claim, settings)


def run_job(job_id: str = "") -> str:
    """One doorbell (worker/run/local.py ``run_job``): the claimed job runs on the executor it
    belongs to."""
    return _run_job(job_id, executor=executor_for)
