"""Job use-cases, by role: submit_checks (what a submit is checked against), the read model
(job objects, pages, events, checkpoints) and the commands (submit, cancel, pause,
resume)."""

from api.services.jobs.commands import cancel_job, pause_job, resume_job, submit_job
from api.services.jobs.read import (
    event_object,
    event_page,
    events_after,
    find_tenant_job,
    get_job_object,
    is_terminal,
    job_object,
    job_objects,
    list_checkpoints,
    list_events,
    list_jobs,
    read_job_object,
    relative_to_job_dir,
    shows_own_rows_only,
    tracking_links,
)
from api.services.jobs.submit_checks import (
    DataSummary,
    context_problems,
    fleet_problems,
    nul_problems,
    registered_fleet,
    validate_submission,
)

__all__ = [
    "DataSummary",
    "cancel_job",
    "context_problems",
    "event_object",
    "event_page",
    "events_after",
    "find_tenant_job",
    "fleet_problems",
    "get_job_object",
    "is_terminal",
    "job_object",
    "job_objects",
    "list_checkpoints",
    "list_events",
    "list_jobs",
    "nul_problems",
    "pause_job",
    "read_job_object",
    "registered_fleet",
    "relative_to_job_dir",
    "resume_job",
    "shows_own_rows_only",
    "submit_job",
    "tracking_links",
    "validate_submission",
]
