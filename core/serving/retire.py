"""OpenAI's ``models.delete`` of a fine-tuned model: its names become unknown (the job
stays), and the engines drop it - its adapters unloaded, a full model's deployment
stopped."""

from __future__ import annotations

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from core.db.models import Job, utcnow
from core.serving import adapters, deployments
from core.serving.tables import Deployment, DeploymentAdapter


def retire(session: Session, job: Job) -> None:
    job.model_deleted_at = utcnow()
    session.commit()
    loaded = session.execute(select(DeploymentAdapter.name, Deployment).join(
        Deployment, Deployment.id == DeploymentAdapter.deployment_id).where(
        or_(DeploymentAdapter.name == job.id,
            DeploymentAdapter.name.like(f"{job.id}-ckpt-%")))).all()
    for name, dep in loaded:
        adapters.unload(session, dep, name)
    for dep_id in session.scalars(select(Deployment.id).where(Deployment.job_id == job.id)):
        deployments.stop(session, dep_id)
