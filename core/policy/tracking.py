"""Experiment tracking: which trackers a job may use, and where they write.

A spec only names trackers (tracking.report_to); the destinations (MLflow tracking URI, W&B
project, entity, server) come from the operator's settings, resolved here into spec.json's
``runtime.tracking`` for the trainer. A spec may pick another MLflow URI only from the
operator's allowlist: a tenant must not make the trainer send the spec, metrics and adapter
to a server of its choosing.
"""

from __future__ import annotations

from typing import Any

from core.infra.errors import ErrorCode
from core.infra.settings import Settings
from core.policy.refusal import Refusal
from core.spec import JobSpec, TrackingSpec

# The trainer writes TensorBoard event files and offline W&B runs under these job-dir names.
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


def tracking_refusals(t: TrackingSpec, settings: Settings) -> list[Refusal]:
    """Every tracker or destination in the spec that this server does not allow."""
    out: list[Refusal] = []
    refused = [name for name in t.report_to if name not in settings.tracking_allowed]
    if refused:
        allowed = ", ".join(settings.tracking_allowed) or "none"
        out.append(
            Refusal(
                ErrorCode.invalid_spec,
                "tracking.report_to",
                f"{', '.join(refused)} not enabled on this server (allowed: {allowed})",
            )
        )
    uri = t.mlflow_tracking_uri
    allowed_uris = (settings.mlflow_tracking_uri, *settings.mlflow_allowed_tracking_uris)
    if uri is not None and uri not in allowed_uris:
        out.append(
            Refusal(
                ErrorCode.invalid_spec,
                "tracking.mlflow_tracking_uri",
                "not a tracking URI this server allows (its mlflow_allowed_tracking_uris); "
                "leave it out to use the server's",
            )
        )
    return out


def mlflow_ui_url(settings: Settings, tracking_uri: str) -> str | None:
    """Base URL for links to MLflow runs: the operator's UI, or an http(s) tracking server."""
    if tracking_uri == settings.mlflow_tracking_uri and settings.mlflow_ui_url:
        return settings.mlflow_ui_url.rstrip("/")
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return None


def resolve_tracking(
    spec: JobSpec, settings: Settings, *, job_id: str, tenant_id: str
) -> dict[str, Any] | None:
    """spec.tracking + the operator's settings -> spec.json runtime.tracking (None: no
    tracker). Call after ``tracking_refusals`` found nothing."""
    t = spec.tracking
    if not t.report_to:
        return None
    out: dict[str, Any] = {
        "report_to": list(t.report_to),
        "run_name": t.run_name or spec.name or job_id,
        # ftune's own tags last: a spec cannot pass a run off as another job's or tenant's.
        "tags": {**t.tags, "ftune.job_id": job_id, "ftune.tenant_id": tenant_id},
    }
    if "mlflow" in t.report_to:
        uri = t.mlflow_tracking_uri or settings.mlflow_tracking_uri
        assert uri is not None  # Settings refuses mlflow allowed without a URI
        out["mlflow"] = {
            "tracking_uri": uri,
            # One experiment per tenant: MLflow's permissions are per experiment.
            "experiment_name": f"{settings.mlflow_experiment_name}/{tenant_id}",
            "artifact_location": settings.mlflow_artifact_location,
            "ui_url": mlflow_ui_url(settings, uri),
        }
    if "wandb" in t.report_to:
        out["wandb"] = {
            "mode": settings.wandb_mode,
            "project": settings.wandb_project,
            "entity": settings.wandb_entity,
            "base_url": settings.wandb_base_url,
        }
    return out
