"""A rank the kernel's OOM killer kills, for real: the worker runs in a memory cgroup of its
own with a limit (as in a container with a memory limit), the fake trainer's rank takes
memory after its first checkpoint until the kernel kills it. The worker names the OOM killer
(its cgroup's OOM kill counter, or the kernel's record where readable) and, as for any
outside kill, requeues the job, which resumes from its checkpoint (worker/run/outside_kill.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.db.models import JobStatus
from core.run.jobdir import JobDir
from testkit.wait import wait_until
from tests.utils.cgroups import memory_cgroup, unavailable
from tests.utils.worker import WorkerEnv, events_of, fake_job, get_job, statuses
from worker.run import process_tree
from worker.run.local import run_job

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no memory cgroup: {REASON}")

# The worker, as `ftune worker` runs one job: what run_job returns is its last line.
RUN_JOB = "import sys\nfrom worker.run.local import run_job\nprint(run_job(sys.argv[1]))\n"


@pytest.mark.slow
def test_a_rank_the_oom_killer_killed_resumes_from_its_checkpoint(wenv: WorkerEnv) -> None:
    job_id = fake_job(wenv, "oom", training={"max_steps": 12, "save_steps": 4})
    jd = JobDir(wenv.settings.jobs_dir / job_id)
    # Room for the worker, the launcher (torch imported) and the rank's start; the rank's
    # memory, once it takes it, is far the largest: the OOM killer picks it.
    with memory_cgroup(limit_mb=1200) as cgroup:
        done = subprocess.run(cgroup.enter([sys.executable, "-c", RUN_JOB, job_id]),
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.stdout.strip().splitlines()[-1:] == [JobStatus.queued], done.stderr[-3000:]
        assert cgroup.oom_kills() >= 1  # the kernel's OOM killer did it
    (requeued,) = events_of(job_id, "requeued")
    assert "killed from outside with SIGKILL by the kernel's OOM killer" in requeued.message
    assert "resumes from its latest checkpoint" in requeued.message
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
    checkpoint = jd.latest_checkpoint()
    assert checkpoint is not None and checkpoint.name == "checkpoint-4"

    assert run_job(job_id) == JobStatus.succeeded  # outside the cgroup: no limit this time
    job = get_job(job_id)
    assert (job.attempt, job.step, job.error_code) == (2, 12, None)
    started = events_of(job_id, "started")
    assert started[-1].data["resumed_from"] == "checkpoints/checkpoint-4"
    assert {e.data["step"] for e in events_of(job_id, "progress")} == set(range(1, 13))
    assert statuses(job_id) == ["running", "queued", "running", "succeeded"]


def test_the_cgroups_counter_names_the_oom_killer_without_the_kernels_log() -> None:
    """What a worker that may not read /dev/kmsg (not root: the Docker image's user) goes
    by: the OOM kill counter of the memory cgroup its run's processes were seen in."""
    from worker.run.outside_kill import OomCounters, outside_kill

    hog = "b = []\nwhile True: b.append(bytearray(b'x' * (50 << 20)))\n"
    with memory_cgroup(limit_mb=200) as cgroup:
        proc = subprocess.Popen(cgroup.enter(["/bin/sh", "-c", "read _; exec \"$0\" -c \"$1\"",
                                              sys.executable, hog]),
                                stdin=subprocess.PIPE)
        wait_until(lambda: proc.pid in cgroup.pids(), 30, "the process in the cgroup")
        counters = OomCounters()
        counters.see([proc.pid])  # as the worker's watch sees a new rank
        assert proc.stdin is not None
        proc.stdin.close()  # now it takes memory
        assert proc.wait(60) == -9
        assert counters.kills_since() == 1
        killed = outside_kill(-9, None, [], cgroup_oom_kills=counters.kills_since())
    assert killed is not None and killed.oom
