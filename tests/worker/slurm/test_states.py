"""SLURM job states -> the job's outcome (worker/slurm/states.py), and squeue's JSON."""

from __future__ import annotations

import json

import pytest

from core.db.models import JobStatus
from core.infra.errors import ErrorCode
from core.jobs.state import StopReason
from worker.run.verdict import REQUEUE, Evidence
from worker.slurm.commands import parse_sacct, parse_squeue_json
from worker.slurm.states import Phase, memory_killed, phase, verdict, waiting_for

DONE = Evidence(0, adapter_present=True)


@pytest.mark.parametrize("state,expected", [
    ("PENDING", Phase.waiting), ("REQUEUED", Phase.waiting), ("SUSPENDED", Phase.waiting),
    ("RUNNING", Phase.running), ("COMPLETING", Phase.running),
    ("COMPLETED", Phase.ended), ("TIMEOUT", Phase.ended), ("NODE_FAIL", Phase.ended),
])
def test_phase(state: str, expected: Phase) -> None:
    assert phase(state) == expected


def test_waiting_for_shows_slurms_reason() -> None:
    assert waiting_for("PENDING", "Resources") == "SLURM pending: Resources"
    assert waiting_for("PENDING", "None") == "SLURM pending: its turn"


def test_completed_needs_the_verified_adapter() -> None:
    assert verdict("COMPLETED", DONE, slurm_job_id="7").status == JobStatus.succeeded
    bad = verdict("COMPLETED", Evidence(0, adapter_present=True, adapter_problem="empty"),
                  slurm_job_id="7")
    assert (bad.status, bad.code) == (JobStatus.failed, ErrorCode.adapter_invalid)
    none = verdict("COMPLETED", Evidence(0), slurm_job_id="7")
    assert (none.status, none.code) == (JobStatus.failed, ErrorCode.trainer_crashed)


def test_failed_keeps_the_trainers_classification() -> None:
    v = verdict("FAILED", Evidence(1, error={"code": "nan_loss", "message": "loss is nan"}),
                slurm_job_id="7")
    assert (v.status, v.code, v.message) == (JobStatus.failed, ErrorCode.nan_loss, "loss is nan")


def test_timeout_and_out_of_memory() -> None:
    v = verdict("TIMEOUT", Evidence(None), slurm_job_id="7", time_minutes=1)
    assert (v.status, v.code) == (JobStatus.failed, ErrorCode.timeout)
    assert "time limit of 1 min" in (v.message or "")
    v = verdict("OUT_OF_MEMORY", Evidence(None), slurm_job_id="7")
    assert (v.status, v.code) == (JobStatus.failed, ErrorCode.out_of_memory)


@pytest.mark.parametrize("state", ["NODE_FAIL", "PREEMPTED", "BOOT_FAIL"])
def test_node_failure_and_preemption_requeue(state: str) -> None:
    v = verdict(state, Evidence(None), slurm_job_id="7")
    assert v.status == REQUEUE and state in (v.message or "")


def test_cancelled_by_us_or_from_outside() -> None:
    ours = verdict("CANCELLED", Evidence(None, stop_reason=StopReason.cancel), slurm_job_id="7")
    assert (ours.status, ours.message) == (JobStatus.cancelled, None)
    outside = verdict("CANCELLED", Evidence(None), slurm_job_id="7")
    assert outside.status == JobStatus.cancelled
    assert "outside the service" in (outside.message or "")


def test_a_cancel_we_sent_wins_over_a_completed_run() -> None:
    assert verdict("COMPLETED", Evidence(0, stop_reason=StopReason.cancel, adapter_present=True),
                   slurm_job_id="7").status == JobStatus.cancelled


def test_unknown_final_state_fails_naming_it() -> None:
    v = verdict("SPECIAL_EXIT", Evidence(None), slurm_job_id="7")
    assert v.status == JobStatus.failed and "SPECIAL_EXIT" in (v.message or "")


def test_squeue_json_of_22_05_and_later() -> None:
    old = {"jobs": [{"job_id": 12, "name": "ftune-job_a-a1", "job_state": "PENDING",
                     "state_reason": "Resources", "nodes": "", "exit_code": 0,
                     "time_limit": 1}]}
    new = {"jobs": [{"job_id": 13, "name": "x", "job_state": ["COMPLETED"],
                     "state_reason": "None", "nodes": "n[1-2]",
                     "exit_code": {"status": ["SUCCESS"], "return_code": {"number": 3}},
                     "time_limit": {"set": True, "infinite": False, "number": 90}}]}
    (a,) = parse_squeue_json(json.dumps(old))
    (b,) = parse_squeue_json(json.dumps(new))
    assert (a.job_id, a.name, a.state, a.reason, a.exit_code, a.time_limit_minutes) == (
        "12", "ftune-job_a-a1", "PENDING", "Resources", 0, 1)
    assert (b.job_id, b.state, b.nodes, b.exit_code, b.time_limit_minutes) == (
        "13", "COMPLETED", "n[1-2]", 3, 90)


def test_an_unlimited_squeue_time_limit_is_none() -> None:
    (j,) = parse_squeue_json(json.dumps({"jobs": [
        {"job_id": 1, "name": "x", "job_state": ["RUNNING"],
         "time_limit": {"set": True, "infinite": True, "number": 0}}]}))
    assert j.time_limit_minutes is None


def test_sacct_lines() -> None:
    text = ("41|ftune-job_a-a1|CANCELLED by 0|0:15|00:01:00\n"
            "42|ftune-job_a-a2|PREEMPTED|0:0|1-02:00:00\n"
            "43|ftune-job_a-a3|COMPLETED|3:0|UNLIMITED\n"
            "44_1|array|RUNNING|0:0|00:01:00\n"
            "garbage\n")
    jobs = parse_sacct(text)
    assert [(j.job_id, j.name, j.state, j.exit_code, j.time_limit_minutes) for j in jobs] == [
        ("41", "ftune-job_a-a1", "CANCELLED", 0, 1), ("42", "ftune-job_a-a2", "PREEMPTED", 0, 1560),
        ("43", "ftune-job_a-a3", "COMPLETED", 3, None)]


# As SLURM 22.05 wrote them into the job's output on the test cluster: the cgroup OOM killer
# (task/cgroup, ConstrainRAMSpace) and the accounting poller (OverMemoryKill).
CGROUP_OOM = ["srun: error: n1: task 0: Out Of Memory",
              ("slurmstepd-n1: error: Detected 1 oom-kill event(s) in StepId=1.0. Some of your "
              "processes may have been killed by the cgroup out-of-memory handler.")]
POLLER_KILL = [("slurmstepd-n2: error: StepId=1.0 exceeded memory limit (534786048 > 209715200), "
               "being killed"), "srun: error: n2: task 1: Killed"]


@pytest.mark.parametrize("lines", [CGROUP_OOM[:1], CGROUP_OOM[1:], POLLER_KILL[:1]])
def test_a_step_killed_for_its_memory_is_out_of_memory(lines: list[str]) -> None:
    assert memory_killed(["fake trainer: train from step 0 to 20", *lines])
    v = verdict("FAILED", Evidence(1), slurm_job_id="7", memory_killed=memory_killed(lines))
    assert (v.status, v.code) == (JobStatus.failed, ErrorCode.out_of_memory)


def test_other_failures_are_not_memory() -> None:
    assert not memory_killed(["srun: error: n2: task 1: Killed",
                              "srun: error: n1: task 0: Exited with exit code 1",
                              "RuntimeError: out of memory in my own code"])
    done = verdict("COMPLETED", DONE, slurm_job_id="7", memory_killed=True)
    assert done.status == JobStatus.succeeded  # a kill it survived does not undo the adapter
