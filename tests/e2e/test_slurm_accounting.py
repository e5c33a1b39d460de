"""What SLURM decides about a job beyond its own run, through the real API, database and a
SLURM worker, on a cluster of its own (testkit/slurm.py) with accounting (slurmdbd on a
private MariaDB), MinJobAge of 2 s (squeue forgets an ended job seconds after it ended), a
partition whose jobs preempt the service's (preempt/partition_prio, PreemptMode=REQUEUE),
and a memory limit per job and node (DefMemPerNode, enforced by OverMemoryKill).

Its own cluster, not test_slurm.py's: a preempting job takes every node, a short MinJobAge
would make that module's checks of squeue racy, and the real trainer's ranks would not fit
the memory limit. Accounting adds ~3 s to the cluster's start here (MariaDB's data
directory, slurmdbd).

A job whose state is OUT_OF_MEMORY is not here: SLURM 22.05 gives it only when the batch
step itself runs out of memory, and the ranks run in step 0 under srun, so a rank killed for
its memory (by the cgroup OOM killer, or here by OverMemoryKill) ends the job FAILED; the
service reads the kill in the job's output (tests/worker/slurm/test_states.py has both).
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import FtuneClient
from testkit.faultstack import FaultStack
from testkit.slurm import SlurmCluster, unavailable
from testkit.wait import wait_until
from tests.utils.slurm import (
    assert_no_process_left,
    cluster_env,
    fake_spec,
    slurm_ids,
    slurm_state,
    stack_env,
    wait_running_on_both_nodes,
    wait_slurm_pending,
)

pytestmark = pytest.mark.e2e

REASON = unavailable(accounting=True)
if REASON:  # pragma: no cover - this machine has root, namespaces, slurmdbd and MariaDB
    pytest.skip(f"no SLURM cluster with accounting here: {REASON}", allow_module_level=True)

URGENT = "urgent"
# Per node: the launcher (torch imported, ~230 MB) and a fake rank fit 3 times over.
JOB_MEMORY_MB = 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path_factory.mktemp("slurm-acct"), accounting=True, min_job_age=2,
                     preempting_partition=URGENT, job_memory_mb=JOB_MEMORY_MB).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stack(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory, pg_url: str,
          models_dir: Path) -> Iterator[FaultStack]:
    """API + one SLURM worker, which a test may SIGKILL and start again."""
    s = FaultStack(data_dir=tmp_path_factory.mktemp("slurm-acct-stack"),
                   api_key="ft_test_" + secrets.token_hex(16), workers=1,
                   env_overrides=stack_env(cluster, tmp_path_factory.mktemp("shared"), pg_url,
                                           models_dir))
    s.start()
    yield s
    s.stop()


def test_a_job_that_ended_unwatched_takes_its_state_from_sacct(
        client: FtuneClient, cluster: SlurmCluster, stack: FaultStack, data_file: str,
        tiny_causal_lm: Path) -> None:
    job = client.create_job(fake_spec("slow", tiny_causal_lm, data_file))
    slurm_id = wait_running_on_both_nodes(cluster, client, job["id"])
    stack.kill_worker(0)  # nobody watches the SLURM job now
    subprocess.run(["scancel", slurm_id], env=cluster_env(cluster), check=True)
    wait_until(lambda: slurm_state(cluster, slurm_id) == "", 60,
               "squeue to forget the ended SLURM job")
    assert cluster.sacct_state(slurm_id) == "CANCELLED"
    # The job dir's exit file cannot say CANCELLED: only accounting knows it.
    stack.start_worker(0)  # its reconciler requeues the job; it claims and adopts it
    done = client.wait(job["id"], timeout=90)
    assert done["status"] == "cancelled", done
    assert done["attempt"] == 2
    notes = [e["message"] for e in client.events(job["id"]) if e["type"] == "slurm"]
    assert any(f"adopted SLURM job {slurm_id}" in m for m in notes), notes
    assert any("cancelled outside the service" in m for m in notes), notes
    assert slurm_ids(client, job["id"]) == [slurm_id], "submitted to SLURM again"


def test_preemption_requeues_and_resumes_from_the_checkpoint(
        client: FtuneClient, cluster: SlurmCluster, data_file: str,
        tiny_causal_lm: Path) -> None:
    job = client.create_job(fake_spec("train", tiny_causal_lm, data_file, max_steps=40,
                                      save_steps=4))
    first = wait_running_on_both_nodes(cluster, client, job["id"],
                                       ready=lambda j: j["checkpoints_count"] > 0)
    env = cluster_env(cluster)
    # An operator's job in the higher-priority partition wants every node: SLURM preempts.
    urgent = subprocess.run(
        ["sbatch", "--parsable", f"--partition={URGENT}", "--nodes=2", "--exclusive",
         "--job-name=operator-urgent", "--output=/dev/null", "--wrap", "sleep 300"],
        env=env, check=True, capture_output=True, text=True).stdout.strip()
    try:
        # The next attempt waits in SLURM's queue behind the urgent job, and says so.
        wait_slurm_pending(client, job["id"], "the new attempt to wait behind the urgent job")
    finally:
        subprocess.run(["scancel", urgent], env=env, check=False)
    done = client.wait(job["id"], timeout=120)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempt"] == 2 and done["queue"] is None
    assert cluster.sacct_state(first) == "PREEMPTED"
    events = client.events(job["id"])
    assert any(e["type"] == "slurm" and "PREEMPTED" in e["message"] for e in events)
    resumed = [e for e in events if e["type"] == "started" and e["data"].get("attempt") == 2]
    assert resumed and resumed[0]["data"]["resumed_from"], resumed
    assert len(slurm_ids(client, job["id"])) == 2


def test_a_rank_killed_for_its_memory_fails_the_job_as_out_of_memory(
        client: FtuneClient, cluster: SlurmCluster, data_file: str,
        tiny_causal_lm: Path) -> None:
    job = client.create_job(fake_spec("hog", tiny_causal_lm, data_file))
    done = client.wait(job["id"], timeout=120)
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "out_of_memory", done["error"]
    assert "exceeding its memory limit" in done["error"]["message"]
    assert_no_process_left(cluster, client, job["id"])
