"""A rank killed from outside (the OOM killer, an operator's kill) is a system fault: the job
goes back to the queue and resumes from its latest checkpoint, as a lost worker's does. A
rank that crashed by itself stays failed. Real ranks, killed for real: run_job under a real
`accelerate launch` with the fake trainer's resumable mode."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest

from core.db.models import JobStatus
from core.jobs.state import RunOutcome
from core.run.jobdir import JobDir
from core.run.plan import RunPlan
from testkit.wait import wait_until
from tests.utils.worker import WorkerEnv, events_of, fake_job, get_job, set_job, statuses
from worker.run import process_tree
from worker.run.local import run_job


class Running:
    """run_job in a thread, so the test can kill a rank meanwhile."""

    def __init__(self, job_id: str) -> None:
        self.result: str | None = None
        self.thread = threading.Thread(target=self._run, args=(job_id,))
        self.thread.start()

    def _run(self, job_id: str) -> None:
        self.result = run_job(job_id)

    def join(self) -> str | None:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()
        return self.result


def rank_pid(job_id: str, jd: JobDir, rank: int) -> int:
    """The pid of the job's process that runs the trainer as ``rank`` (rank 0 writes its
    own in pids.json; the others are found by their RANK)."""
    if rank == 0:
        return int(json.loads((jd.root / "pids.json").read_text())["trainer"])

    def find() -> int | None:
        for p in process_tree.tagged_prefix(f"{job_id}:"):
            try:
                env = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
                cmd = " ".join(p.cmdline())
            except (OSError, psutil.Error):
                continue
            if f"RANK={rank}".encode() in env and "fake_trainer" in cmd:
                return int(p.pid)
        return None
    return int(wait_until(find, 60, f"rank {rank} of {job_id}"))


def train_job(wenv: WorkerEnv, **distributed: object) -> tuple[str, JobDir]:
    sections = {"distributed": distributed} if distributed else {}
    job_id = fake_job(wenv, "train", training={"max_steps": 40, "save_steps": 4}, **sections)
    return job_id, JobDir(wenv.settings.jobs_dir / job_id)


def kill_after_a_checkpoint(job_id: str, jd: JobDir, rank: int, sig: signal.Signals) -> int:
    running = Running(job_id)
    wait_until(lambda: jd.latest_checkpoint() is not None, 60, "a first checkpoint")
    os.kill(rank_pid(job_id, jd, rank), sig)
    result = running.join()
    assert result is not None
    return result


def test_a_killed_rank_is_resumed_from_its_checkpoint(wenv: WorkerEnv) -> None:
    job_id, jd = train_job(wenv)
    assert kill_after_a_checkpoint(job_id, jd, 0, signal.SIGKILL) == JobStatus.queued

    job = get_job(job_id)
    assert (job.status, job.attempt, job.error_code) == (JobStatus.queued, 1, None)
    (requeued,) = events_of(job_id, "requeued")
    assert "the trainer was killed from outside with SIGKILL" in requeued.message
    assert "system fault" in requeued.message
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
    checkpoint = jd.latest_checkpoint()
    assert checkpoint is not None

    assert run_job(job_id) == JobStatus.succeeded
    job = get_job(job_id)
    assert (job.attempt, job.step) == (2, 40)
    assert RunPlan.read(jd.spec).runtime.resume_from_checkpoint == checkpoint
    steps = [e.data["step"] for e in events_of(job_id, "progress")]
    assert set(steps) == set(range(1, 41))  # nothing lost
    assert statuses(job_id) == ["running", "queued", "running", "succeeded"]


@pytest.mark.e2e  # two ranks of the real trainer: multi-process training, not make test-fast's
def test_a_rank_killed_under_ddp_is_resumed_naming_it(wenv: WorkerEnv) -> None:
    job_id, jd = train_job(wenv, strategy="ddp", num_processes=2)
    assert kill_after_a_checkpoint(job_id, jd, 1, signal.SIGKILL) == JobStatus.queued

    (requeued,) = events_of(job_id, "requeued")
    assert "rank 1 was killed from outside with SIGKILL" in requeued.message
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
    assert run_job(job_id) == JobStatus.succeeded
    assert get_job(job_id).attempt == 2


def test_killed_on_its_last_attempt_it_fails_saying_why(wenv: WorkerEnv) -> None:
    job_id, jd = train_job(wenv)
    set_job(job_id, attempt=wenv.settings.max_attempts - 1)  # this run is the last one
    assert kill_after_a_checkpoint(job_id, jd, 0, signal.SIGKILL) == JobStatus.queued

    assert run_job(job_id) == RunOutcome.skipped  # no attempt left: given up
    job = get_job(job_id)
    assert (job.status, job.error_code) == (JobStatus.failed, "worker_lost")
    assert "the last ended: the trainer was killed from outside with SIGKILL" in (
        job.error_message or "")


def test_a_rank_that_crashed_by_itself_stays_failed(wenv: WorkerEnv) -> None:
    # SIGSEGV is the trainer's own crash (a native library's bug), not an outside kill.
    job_id, jd = train_job(wenv)
    assert kill_after_a_checkpoint(job_id, jd, 0, signal.SIGSEGV) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "trainer_crashed"
    assert "SIGSEGV" in (job.error_message or "")
    assert events_of(job_id, "requeued") == []
    assert json.loads(jd.spec.read_text())["runtime"]["attempt"] == 1


def test_the_signal_is_read_from_each_launcher_s_report() -> None:
    from worker.run.outside_kill import OutsideKill, outside_kill

    simple = [("subprocess.CalledProcessError: Command '['python', '-m', 'core.train']' died "
               "with <Signals.SIGKILL: 9>.")]
    assert outside_kill(1, None, simple) == OutsideKill("SIGKILL")
    aborted = [simple[0].replace("SIGKILL: 9", "SIGABRT: 6")]
    assert outside_kill(1, None, aborted) is None
    assert outside_kill(1, (1, -15), ["  exitcode  : -15 (pid: 12)"]) == OutsideKill("SIGTERM", 1)
    assert outside_kill(1, (1, 1), []) is None  # it raised
    assert outside_kill(-9, None, []) == OutsideKill("SIGKILL")  # the launcher itself
    assert outside_kill(3, None, ["Traceback", "ValueError: x"]) is None


def test_a_cancel_or_the_deadline_wins_over_an_outside_kill() -> None:
    from worker.run.outside_kill import OutsideKill
    from worker.run.verdict import REQUEUE, Evidence, decide

    killed = OutsideKill("SIGKILL", 0, oom=True)
    assert decide(Evidence(1, killed=killed)).status == REQUEUE
    assert "OOM killer" in (decide(Evidence(1, killed=killed)).message or "")
    assert decide(Evidence(1, killed=killed, cancel_requested=True)).status == "cancelled"
    assert decide(Evidence(1, killed=killed, deadline_passed=True)).code == "timeout"
