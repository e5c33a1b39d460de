"""One real worker process (`ftune worker`'s Celery command: threads pool, a slot per GPU)
with a simulated 4-GPU inventory runs several fake-trainer jobs at once under `accelerate
launch`, each on its own GPU with its own rendezvous port; the fake trainer fails any job
whose CUDA_VISIBLE_DEVICES is not the GPUs it was given. A CPU worker with 2 slots runs two
jobs side by side, each on its slot's own cores with as many OpenMP threads."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cli.embedded import worker_argv
from core.db.models import JobStatus, utcnow
from core.jobs.dispatch import enqueue_job
from core.run.jobdir import JobDir
from testkit.launch import REPO_ROOT
from testkit.wait import wait_until
from tests.utils.worker import WorkerEnv, fake_job, get_job, subprocess_env
from worker.run.claim import Claim
from worker.run.prepare import slot_share
from worker.upkeep.registry import slot_cpus, usable_cpus

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def own_pg() -> Iterator[str]:
    from testkit.pg import migrated_database

    with migrated_database() as url:
        yield url


def test_one_worker_runs_jobs_side_by_side_on_disjoint_gpus(
        tmp_path: Path, own_pg: str, configure: Callable[..., WorkerEnv]) -> None:
    w = configure(tmp_path, own_pg, FTUNE_FAKE_GPUS="4", FTUNE_WORKER_GPUS="4",
                  FAKE_STEP_SECONDS="0.2", FTUNE_RECONCILE_INTERVAL_SECONDS="3600")
    jobs = [fake_job(w, "train", training={"max_steps": 15}) for _ in range(3)]
    placed = run_to_success(w, jobs, "slices@%h", subprocess_env(w.env), tmp_path)
    gpus = [tuple(p["gpu_ids"]) for p in placed]
    assert all(len(g) == 1 for g in gpus) and len(set(gpus)) == 3
    assert [p["cuda_visible_devices"] for p in placed] == [str(g[0]) for g in gpus]
    assert len({p["main_process_port"] for p in placed}) == 3
    # Side by side: each job started before the others ended.
    assert max(p["started"] for p in placed) < min(p["ended"] for p in placed)
    assert "--concurrency" not in " ".join(worker_argv("q", "n"))  # slots come from inventory


def test_two_cpu_jobs_side_by_side_each_get_their_share_of_the_cores(
        tmp_path: Path, own_pg: str, configure: Callable[..., WorkerEnv]) -> None:
    w = configure(tmp_path, own_pg, FTUNE_WORKER_GPUS="0", FTUNE_WORKER_SLOTS="2",
                  FAKE_STEP_SECONDS="0.2", FTUNE_RECONCILE_INTERVAL_SECONDS="3600")
    jobs = [fake_job(w, "train", training={"max_steps": 10}) for _ in range(2)]
    env = subprocess_env(w.env)
    env.pop("OMP_NUM_THREADS", None)  # the suite's own setting would win over the worker's
    placed = run_to_success(w, jobs, "cpu-slots@%h", env, tmp_path)
    assert max(p["started"] for p in placed) < min(p["ended"] for p in placed)  # side by side
    cores = usable_cpus()
    # Each job runs on its own slot's half of the worker's cores, as many OpenMP threads.
    assert sorted(p["cpus"] for p in placed) == [slot_cpus(cores, 2, 0), slot_cpus(cores, 2, 1)]
    assert [p["omp_num_threads"] for p in placed] == [str(len(p["cpus"])) for p in placed]
    if len(cores) >= 2:
        assert set(placed[0]["cpus"]).isdisjoint(placed[1]["cpus"])


def test_cores_split_evenly_between_slots() -> None:
    assert [slot_cpus([0, 1, 2, 3, 4, 5], 4, k) for k in range(4)] == [[0], [1, 2], [3], [4, 5]]
    # Fewer cores than slots: neighbouring slots share one.
    assert [slot_cpus([0, 1], 4, k) for k in range(4)] == [[0], [0], [1], [1]]


def test_pinning_is_the_operators_choice(tmp_path: Path, own_pg: str,
                                         configure: Callable[..., WorkerEnv]) -> None:
    claim = Claim("job-x", "tenant-x", "w", 1, None, utcnow(), cpu_slot=1, cpu_slots=2)
    cores = slot_cpus(usable_cpus(), 2, 1)

    on = configure(tmp_path, own_pg, FTUNE_WORKER_GPUS="0").settings
    assert slot_share(claim, on) == (cores, True)
    off = configure(tmp_path, own_pg, FTUNE_WORKER_GPUS="0",
                    FTUNE_WORKER_PIN_CPUS="false").settings
    assert slot_share(claim, off) == (cores, False)  # the same share of OpenMP threads


def run_to_success(w: WorkerEnv, jobs: list[str], node: str, env: dict[str, str],
                   tmp_path: Path) -> list[dict]:
    """One real worker process runs the jobs until all succeeded (any failure, a dead
    worker or 90 s fails the test); returns each job's placement.json (the fake trainer's
    record of what it was given)."""
    log = tmp_path / "worker.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*worker_argv(w.settings.queue_name, node), "--without-gossip",
             "--without-mingle", "--without-heartbeat"],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        for job_id in jobs:
            enqueue_job(job_id)

        def failed() -> str | None:
            gone = [(j, get_job(j).error_message) for j in jobs
                    if get_job(j).status == JobStatus.failed]
            if gone:
                return f"failed: {gone}"
            return "the worker exited" if proc.poll() is not None else None

        try:
            wait_until(lambda: all(get_job(j).status == JobStatus.succeeded for j in jobs), 90,
                       "every job to succeed", every=0.3, give_up=failed)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()[-3000:]}") from None
    finally:
        proc.terminate()
        proc.wait(30)
    return [json.loads((JobDir(w.settings.jobs_dir / j).root / "placement.json").read_text())
            for j in jobs]
