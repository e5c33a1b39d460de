"""Live SLURM jobs that no worker will ever adopt, found and cancelled by the reconciler."""

from __future__ import annotations

import logging

from sqlalchemy import select

from core.db.models import Job
from core.db.session import session_scope
from core.jobs import state as jobstate
from worker.slurm import commands, script, states
from worker.slurm.commands import SlurmError

log = logging.getLogger(__name__)


def cancel_orphans() -> list[str]:
    """scancel every live SLURM job of this service whose job has ended, so no worker will
    ever adopt it (e.g. cancelled while it sat queued between a worker's exit and the next
    claim). A name whose job is not in this database is left alone: it may belong to
    another deployment on the same cluster. Returns the SLURM job ids cancelled. Runs with
    the reconciler on SLURM workers; safe to run from several at once."""
    live = [j for j in commands.squeue()
            if j.name.startswith(script.JOB_NAME_PREFIX)
            and states.phase(j.state) != states.Phase.ended]
    if not live:
        return []
    owners = {j.job_id: j.name[len(script.JOB_NAME_PREFIX):].rsplit("-a", 1)[0] for j in live}
    with session_scope() as s:
        status = dict(s.execute(select(Job.id, Job.status)
                                .where(Job.id.in_(set(owners.values())))).tuples().all())
    cancelled = []
    for slurm_id, job_id in owners.items():
        if status.get(job_id) not in jobstate.FINISHED:
            continue
        try:
            commands.scancel(slurm_id)
        except SlurmError:
            log.warning("could not scancel orphan SLURM job %s", slurm_id, exc_info=True)
            continue
        log.warning("scancelled SLURM job %s: job %s is %s", slurm_id, job_id,
                    status[job_id])
        cancelled.append(slurm_id)
    return cancelled
