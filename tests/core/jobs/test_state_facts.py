"""core.jobs.state's derived facts: the finished and held statuses, the retry budget and the
status a lost job gets, each defined once (every caller uses these)."""

from __future__ import annotations

import pytest

from core.db.models import JobStatus
from core.jobs import state as jobstate


def test_finished_statuses_are_those_no_move_leaves() -> None:
    sources = {source for source, _move, _target in jobstate.MOVES}
    assert jobstate.FINISHED == frozenset(JobStatus) - sources - {JobStatus.validating}
    assert jobstate.UNFINISHED == frozenset(JobStatus) - jobstate.FINISHED
    assert jobstate.is_finished("succeeded") and not jobstate.is_finished("paused")


def test_a_held_job_is_one_a_worker_runs() -> None:
    assert jobstate.HELD == {JobStatus.running, JobStatus.cancelling, JobStatus.pausing}
    assert not jobstate.HELD & jobstate.FINISHED


def test_attempts_ended_by_a_pause_are_outside_the_budget() -> None:
    assert jobstate.attempts_used(5, 3) == 2
    assert jobstate.has_attempts_left(5, 3, max_attempts=3)
    assert not jobstate.has_attempts_left(3, 0, max_attempts=3)


@pytest.mark.parametrize(("status", "cancel", "attempt", "pauses", "to"), [
    (JobStatus.cancelling, False, 1, 0, JobStatus.cancelled),
    (JobStatus.running, True, 1, 0, JobStatus.cancelled),  # a cancel asked while running
    (JobStatus.pausing, False, 1, 0, JobStatus.paused),
    (JobStatus.running, False, 2, 0, JobStatus.queued),  # attempts left: requeued
    (JobStatus.running, False, 3, 0, JobStatus.failed),  # the budget is spent
    (JobStatus.running, False, 3, 1, JobStatus.queued),  # one attempt was a pause
])
def test_the_status_a_lost_job_gets(status: JobStatus, cancel: bool, attempt: int, pauses: int,
                                    to: JobStatus) -> None:
    assert jobstate.lost_status(status, cancel_requested=cancel, attempt=attempt, pauses=pauses,
                                max_attempts=3) == to
