"""Experiment tracking in the trainer: rank 0 opens the job's trackers (core/run/trackers.py)
and feeds them every value the Trainer logs, at its optimizer step. Only rank 0 tracks: the
Trainer's logged values are already averaged over ranks, and one run per job is what a user
wants to see."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from core.run.trackers import Tracking
from core.train import dist
from core.train.events import EventLog


class TrackingCallback(TrainerCallback):
    """Every Trainer log (train, eval, and the trainer's own extras such as DPO rewards) to
    the trackers, at its optimizer step."""

    def __init__(self, tracking: Tracking) -> None:
        self.tracking = tracking

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        if logs and state.is_world_process_zero:
            self.tracking.log(logs, state.global_step)


def open_tracking(job: Any, events: EventLog, trainer: Any) -> Tracking:
    """The job's trackers, fed by ``trainer``'s logs from now on."""
    rt = job.runtime
    if not dist.is_main():
        return Tracking([], events.emit)
    tracking = Tracking.open(
        job.dir.root, rt.tracking, rt.job_id or job.dir.root.name,
        job.spec.model_dump(mode="json"), events.emit,
    )
    if tracking.trackers:
        trainer.add_callback(TrackingCallback(tracking))
    return tracking
