"""Jobs through the real API, database and a SLURM-executor worker, on a real SLURM cluster
started here: slurmctld and two slurmd "nodes" in network namespaces (testkit/slurm.py).

The 2-node DDP, DeepSpeed ZeRO-3 and GRPO runs use the real trainer; cancel, scancel from outside,
a node failure and the time limit use the fake trainer (testkit/fake_trainer.py: rank 0
writes, rank 1 waits), whose ranks still run under srun + accelerate launch on both nodes.
The time-limit job is submitted first and checked late: SLURM's smallest --time is one
minute and its controller checks limits every 30 s, so it overlaps the other tests on the
second worker, though not the node failure (it has a rank on the node that test kills).

Tests that act on a running job first wait for its ranks on both nodes
(``wait_running_on_both_nodes``): ~6-10 s here from submit, nearly all of it `accelerate
launch` starting on each node (importing torch and accelerate: ~2.3 s of CPU each), far
more on a loaded 2-core machine; a timeout names the stages reached and when.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.embedded import EmbeddedStack
from client import FtuneClient
from testkit.slurm import SlurmCluster, unavailable
from testkit.wait import wait_until
from tests.utils.adapters import assert_adapter_loads
from tests.utils.jobdirs import HAS_DEEPSPEED
from tests.utils.slurm import (
    TWO_NODES,
    assert_no_process_left,
    cluster_env,
    fake_spec,
    grading_processes,
    job_processes_with_env,
    on_both_nodes,
    rank_environs,
    slurm_ids,
    slurm_state,
    stack_env,
    trainer_step_processes,
    wait_running_on_both_nodes,
    wait_slurm_pending,
)
from tests.utils.specs import grpo_spec, lm_spec
from tests.utils.tiny import reinforcement_rows, write_jsonl

pytestmark = pytest.mark.e2e

REASON = unavailable()
if REASON:  # pragma: no cover - this machine has root, namespaces and slurm-wlm
    pytest.skip(f"no SLURM cluster here: {REASON}", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


# The judge endpoint's key the workers hold: only the grading processes may see it.
JUDGE_KEY = "sk-judge-" + "5e1c0d" * 4
LENGTH = {"type": "python", "name": "length",
          "source": "def grade(sample, item):\n"
                    "    return min(1.0, len(sample['output_text']) / 20)\n"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FTUNE_SLURM_SHARED_ROOT: the job directories every node sees."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def stack(cluster: SlurmCluster, shared: Path, tmp_path_factory: pytest.TempPathFactory,
          pg_url: str, models_dir: Path) -> Iterator[EmbeddedStack]:
    """API + two SLURM workers (one is busy with the time-limit job most of the module)."""
    s = EmbeddedStack(
        data_dir=tmp_path_factory.mktemp("slurm-stack"),
        api_key="ft_test_" + secrets.token_hex(16),
        workers=2,
        env_overrides={**stack_env(cluster, shared, pg_url, models_dir),
                       "FTUNE_PYTHON_GRADERS": "true", "FTUNE_GRADER_JUDGE_API_KEY": JUDGE_KEY},
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module", autouse=True)
def time_limited_job(client: FtuneClient, data_file: str, tiny_causal_lm: Path) -> str:
    """Submitted before every other test of this module; test_time_limit checks it."""
    spec = fake_spec("stubborn", tiny_causal_lm, data_file)  # ignores SIGTERM: SLURM kills
    spec["resources"] = {"timeout_seconds": 60}
    return str(client.create_job(spec)["id"])


def test_two_node_ddp_trains_a_loadable_adapter(client: FtuneClient, cluster: SlurmCluster,
                                                data_file: str, tiny_causal_lm: Path,
                                                tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = lm_spec(tiny_causal_lm, data_file, max_steps=4)
    spec["name"] = "ddp over two nodes"  # not fake:*, so the real trainer runs
    spec["distributed"] = dict(TWO_NODES)
    job = client.create_job(spec)
    done = client.wait(job["id"], timeout=300)
    assert done["status"] == "succeeded", done["error"]
    started = [e for e in client.events(job["id"]) if e["type"] == "started"]
    assert started and started[-1]["data"]["world_size"] == 2
    assert started[-1]["data"]["num_machines"] == 2, started[-1]["data"]
    assert started[-1]["data"]["distributed_type"] == "MULTI_CPU"
    launch = client.launch(job["id"])
    assert launch["slurm_job_id"] and launch["argv"][:2] == ["sbatch", "--parsable"]
    assert "srun" in launch["sbatch_script"] and "--nodes=2" in launch["sbatch_script"]
    assert "num_machines: 2" in launch["accelerate_yaml"]
    assert_adapter_loads(client, job["id"], tiny_causal_lm, tmp_path, AutoModelForCausalLM)
    assert_no_process_left(cluster, client, job["id"])


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (extra: deepspeed)")
@pytest.mark.timeout(1200)  # a fresh machine first builds DeepSpeed's cpu_adam (cpu_adam)
def test_two_node_zero3_cpu_offload_trains_a_loadable_adapter(
        cpu_adam: float, client: FtuneClient, cluster: SlurmCluster, data_file: str,
        tiny_causal_lm: Path, tmp_path: Path) -> None:
    """DeepSpeed ZeRO-3, optimizer and parameters offloaded to CPU, one rank per node:
    parameters partitioned across the two machines, and the adapter gathered whole."""
    from transformers import AutoModelForCausalLM

    spec = lm_spec(tiny_causal_lm, data_file, max_steps=2)
    spec["name"] = "zero3 over two nodes"
    spec["distributed"] = {**TWO_NODES, "strategy": "deepspeed", "deepspeed": {
        "zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}}
    job = client.create_job(spec)
    done = client.wait(job["id"], timeout=400)
    assert done["status"] == "succeeded", done["error"]
    (started,) = [e["data"] for e in client.events(job["id"]) if e["type"] == "started"]
    assert (started["world_size"], started["num_machines"]) == (2, 2), started
    assert (started["distributed_type"], started["zero_stage"]) == ("DEEPSPEED", 3), started
    assert started["offload_optimizer_device"] == started["offload_param_device"] == "cpu"
    assert_adapter_loads(client, job["id"], tiny_causal_lm, tmp_path, AutoModelForCausalLM)
    assert_no_process_left(cluster, client, job["id"])


def test_grpo_grades_beside_the_trainer_on_every_node_without_the_key_in_the_trainer(
        client: FtuneClient, cluster: SlurmCluster, shared: Path, tiny_causal_lm: Path,
        tmp_path: Path) -> None:
    """A 2-node GRPO run: the batch script starts a grading process on each node, which
    holds the judge's key and runs the python grader in its sandbox; the ranks grade through
    it, and neither their environment nor the job directory holds the key."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", reinforcement_rows(16, seed=7))
    spec = grpo_spec(tiny_causal_lm, {"file_id": client.upload_file(prompts)["id"]}, LENGTH,
                     max_steps=4, save_steps=100)
    spec["name"] = "grpo over two nodes"
    spec["distributed"] = dict(TWO_NODES)
    job = client.create_job(spec)

    def running() -> dict[str, dict[str, bytes]] | None:
        """Per node, the job's processes, once a grading process and a rank run on each."""
        ids = slurm_ids(client, job["id"])
        seen = {n: job_processes_with_env(cluster, n, ids[-1]) for n in cluster.node_names()
                if ids}
        ok = len(seen) == cluster.nodes and all(
            len(grading_processes(ps)) == 1 and rank_environs(ps) for ps in seen.values())
        return seen if ok else None

    def ended() -> str | None:
        j = client.get_job(job["id"])
        return f"the job ended {j['status']}: {j['error']}" if j["status"] in (
            "succeeded", "failed", "cancelled") else None

    key = JUDGE_KEY.encode()
    on_nodes = wait_until(running, 240, "a grading process and a rank on each node",
                          give_up=ended)
    for node, seen in on_nodes.items():
        (held,) = grading_processes(seen).values()
        assert f"FTUNE_GRADER_JUDGE_API_KEY={JUDGE_KEY}".encode() in held
        for cmdline, env in trainer_step_processes(seen).items():
            assert key not in env, (node, cmdline)
        assert all(b"\0FTUNE_GRADING_SOCKET=" in e for e in rank_environs(seen)), node
    (slurm_id,) = slurm_ids(client, job["id"])
    done = client.wait(job["id"], timeout=400)
    assert done["status"] == "succeeded", done["error"]
    rewards = [e["data"]["reward"] for e in client.events(job["id"])
               if e["type"] == "progress" and "reward" in e["data"]]
    assert len(rewards) == 4 and all(0 < r <= 1 for r in rewards), rewards
    job_dir = shared / job["id"]
    assert {p.name for p in job_dir.glob("grading-*.log")} == {"grading-n1.log", "grading-n2.log"}
    for path in job_dir.rglob("*"):
        if path.is_file():
            assert key not in path.read_bytes(), path
    assert_no_process_left(cluster, client, job["id"])
    temp = Path(os.environ.get("TMPDIR", "/tmp"))
    assert not list(temp.glob(f"ftune-{job['id']}-a1-{slurm_id}-*")), "a socket folder is left"


def test_cancel_stops_every_rank_on_every_node(client: FtuneClient, cluster: SlurmCluster,
                                               data_file: str, tiny_causal_lm: Path) -> None:
    job = client.create_job(fake_spec("slow", tiny_causal_lm, data_file))
    wait_running_on_both_nodes(cluster, client, job["id"])
    client.cancel_job(job["id"])
    done = client.wait(job["id"], timeout=60)
    assert done["status"] == "cancelled"
    stopped = [e for e in client.events(job["id"]) if e["type"] == "stopped"]
    assert stopped, "the trainer did not stop gracefully (no 'stopped' event)"
    assert_no_process_left(cluster, client, job["id"])


def test_scancel_from_outside_cancels_the_job_saying_so(client: FtuneClient,
                                                        cluster: SlurmCluster, data_file: str,
                                                        tiny_causal_lm: Path) -> None:
    job = client.create_job(fake_spec("slow", tiny_causal_lm, data_file))
    slurm_id = wait_running_on_both_nodes(cluster, client, job["id"])
    subprocess.run(["scancel", slurm_id], env=cluster_env(cluster), check=True)
    done = client.wait(job["id"], timeout=60)
    assert done["status"] == "cancelled"
    notes = [e["message"] for e in client.events(job["id"]) if e["type"] == "slurm"]
    assert any("cancelled outside the service" in m for m in notes), notes
    assert_no_process_left(cluster, client, job["id"])


def test_reconciler_scancels_a_slurm_job_whose_job_ended(cluster: SlurmCluster,
                                                         pg_url: str) -> None:
    from sqlalchemy import create_engine, insert, select

    from core.db.models import Job, Tenant

    engine = create_engine(pg_url)
    try:
        with engine.begin() as conn:
            tenant = conn.scalar(select(Tenant.id).limit(1))
            ended = f"job-ended{secrets.token_hex(6)}"
            conn.execute(insert(Job).values(id=ended, tenant_id=tenant, status="cancelled",
                                            spec={}, attempt=1))
    finally:
        engine.dispose()
    stranger = f"job-elsewhere{secrets.token_hex(6)}"  # not in this database
    env = cluster_env(cluster)

    def sbatch(job_id: str) -> str:
        out = subprocess.run(["sbatch", "--parsable", f"--job-name=ftune-{job_id}-a1",
                              "--output=/dev/null", "--wrap", "sleep 300"], env=env,
                             check=True, capture_output=True, text=True)
        return out.stdout.strip()

    orphan, foreign = sbatch(ended), sbatch(stranger)
    try:
        wait_until(lambda: slurm_state(cluster, orphan) == "CANCELLED", 30,
                   "the reconciler to scancel the orphan")
        assert slurm_state(cluster, foreign) in ("PENDING", "RUNNING")
    finally:
        subprocess.run(["scancel", orphan, foreign], env=env, check=False)


def test_node_failure_requeues_and_resumes_from_the_checkpoint(
        client: FtuneClient, cluster: SlurmCluster, data_file: str, tiny_causal_lm: Path,
        time_limited_job: str) -> None:
    # Not while the time-limit job runs: it has a rank on the node killed below, and would
    # end NODE_FAIL (requeued) instead of TIMEOUT.
    client.wait(time_limited_job, timeout=150)
    job = client.create_job(fake_spec("train", tiny_causal_lm, data_file, max_steps=60,
                                      save_steps=4))
    wait_running_on_both_nodes(cluster, client, job["id"],
                               ready=lambda j: j["checkpoints_count"] > 0)
    cluster.kill_node("n2")
    try:
        # The next attempt waits in SLURM's queue for a second node, and says so.
        wait_slurm_pending(client, job["id"], "the new attempt to wait for a node")
    finally:
        cluster.revive_node("n2")  # a failure here must not leave the next tests one node
    done = client.wait(job["id"], timeout=120)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempt"] == 2 and done["queue"] is None
    events = client.events(job["id"])
    assert any(e["type"] == "slurm" and "NODE_FAIL" in e["message"] for e in events)
    resumed = [e for e in events if e["type"] == "started" and e["data"].get("attempt") == 2]
    assert resumed and resumed[0]["data"]["resumed_from"], resumed
    assert_no_process_left(cluster, client, job["id"])


def test_time_limit_fails_the_job_as_timeout(client: FtuneClient, cluster: SlurmCluster,
                                             time_limited_job: str) -> None:
    done = client.wait(time_limited_job, timeout=150)
    assert done["status"] == "failed" and done["error"]["code"] == "timeout", done["error"]
    assert "time limit of 1 min" in done["error"]["message"]
    assert_no_process_left(cluster, client, time_limited_job)


def test_another_worker_takes_over_a_running_slurm_job(
        client: FtuneClient, cluster: SlurmCluster, stack: EmbeddedStack, data_file: str,
        tiny_causal_lm: Path, time_limited_job: str, pg_url: str) -> None:
    client.wait(time_limited_job, timeout=150)  # both workers free
    job = client.create_job(fake_spec("slow", tiny_causal_lm, data_file))
    slurm_id = wait_running_on_both_nodes(cluster, client, job["id"])
    pid = worker_pid_of(pg_url, job["id"])
    (victim,) = [p for p in stack.procs if p.pid == pid]
    victim.kill()  # no chance to hand anything back
    victim.wait(10)
    # The SLURM job runs on; the reconciler requeues the job and the other worker adopts it.
    events = wait_until(lambda: [e for e in client.events(job["id"])
                                 if e["type"] == "slurm" and "adopted" in e["message"]], 60,
                        "the other worker to adopt the SLURM job")
    assert events[0]["data"]["slurm_job_id"] == slurm_id
    assert on_both_nodes(cluster, client, job["id"]), "the takeover restarted or stopped ranks"
    assert client.get_job(job["id"])["attempt"] == 2
    client.cancel_job(job["id"])
    assert client.wait(job["id"], timeout=60)["status"] == "cancelled"
    assert_no_process_left(cluster, client, job["id"])


def worker_pid_of(db_url: str, job_id: str) -> int:
    """The pid in the job's worker_id (host:pid): the Celery worker holding it."""
    from sqlalchemy import create_engine, select

    from core.db.models import Job

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            worker_id = conn.scalar(select(Job.worker_id).where(Job.id == job_id))
    finally:
        engine.dispose()
    assert worker_id, "the job has no worker"
    return int(worker_id.rsplit(":", 1)[1])

