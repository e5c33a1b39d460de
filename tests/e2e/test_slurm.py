"""Jobs through the real API, database and a SLURM-executor worker, on a real SLURM cluster
started here: slurmctld and two slurmd "nodes" in network namespaces (testkit/slurm.py).

The 2-node DDP and DeepSpeed ZeRO-3 runs use the real trainer; cancel, scancel from outside,
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

import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cli.embedded import EmbeddedStack
from client import FtuneClient
from testkit.slurm import SlurmCluster, unavailable
from testkit.wait import wait_until
from tests.core.train.test_deepspeed_runs import HAS_DEEPSPEED
from tests.e2e.test_stack import assert_adapter_loads, lm_spec
from tests.utils.services import REDIS_URL

pytestmark = pytest.mark.e2e

REASON = unavailable()
if REASON:  # pragma: no cover - this machine has root, namespaces and slurm-wlm
    pytest.skip(f"no SLURM cluster here: {REASON}", allow_module_level=True)

TWO_NODES = {"strategy": "ddp", "num_processes": 2, "num_machines": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stack(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory, pg_url: str,
          models_dir: Path) -> Iterator[EmbeddedStack]:
    """API + two SLURM workers (one is busy with the time-limit job most of the module)."""
    s = EmbeddedStack(
        data_dir=tmp_path_factory.mktemp("slurm-stack"),
        api_key="ft_test_" + secrets.token_hex(16),
        workers=2,
        env_overrides=stack_env(cluster, tmp_path_factory.mktemp("shared"), pg_url,
                                models_dir),
    )
    s.start()
    yield s
    s.stop()


def stack_env(cluster: SlurmCluster, shared: Path, pg_url: str,
              models_dir: Path) -> dict[str, str]:
    """What the API and the SLURM workers of a test stack need (a queue of its own)."""
    return {
        **cluster.env,
        "DATABASE_URL": pg_url,
        "BROKER_URL": REDIS_URL,
        "FTUNE_QUEUE_NAME": f"ftune.test.slurm.{secrets.token_hex(4)}",
        "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
        "FTUNE_TRAINER_MODULE": "testkit.fake_trainer",  # fake:* names; else core.train
        "FTUNE_CANCEL_GRACE_SECONDS": "5",
        "FTUNE_SLURM_PARTITION": cluster.partition,
        "FTUNE_SLURM_MAX_NODES": "2",
        "FTUNE_SLURM_CPUS_PER_NODE": str(cluster.cpus),
        "FTUNE_SLURM_SHARED_ROOT": str(shared),
        "FTUNE_SLURM_POLL_SECONDS": "0.5",
        # A SIGKILLed worker's job is given to another one within seconds.
        "FTUNE_HEARTBEAT_SECONDS": "1",
        "FTUNE_HEARTBEAT_TIMEOUT_SECONDS": "6",
        "FTUNE_RECONCILE_INTERVAL_SECONDS": "1",
    }


@pytest.fixture(scope="module", autouse=True)
def time_limited_job(client: FtuneClient, data_file: str, tiny_causal_lm: Path) -> str:
    """Submitted before every other test of this module; test_time_limit checks it."""
    spec = fake_spec("stubborn", tiny_causal_lm, data_file)  # ignores SIGTERM: SLURM kills
    spec["resources"] = {"timeout_seconds": 60}
    return str(client.create_job(spec)["id"])


def fake_spec(mode: str, model: Path, file_id: str, **training: object) -> dict:
    spec = lm_spec(model, file_id, **training)
    spec["name"] = f"fake:{mode}"
    spec["distributed"] = dict(TWO_NODES)
    return spec


# What a requeued job says between its requeue and the pool's worker submitting it again to
# SLURM (seconds on a loaded machine): it waits for that worker.
BEFORE_SUBMIT = ("", "a worker of a pool with its own scheduler (SLURM) will submit it there")


def wait_slurm_pending(client: FtuneClient, job_id: str, what: str) -> None:
    """Until the job's queue message says it waits in SLURM's queue; every message seen on
    the way must be one of BEFORE_SUBMIT (no other reason is a right one)."""
    seen: list[str] = []

    def slurm_pending() -> bool:
        message = (client.get_job(job_id)["queue"] or {}).get("message") or ""
        seen.append(message)
        return message.startswith("SLURM pending")

    wait_until(slurm_pending, 60, what)
    assert all(m in BEFORE_SUBMIT or m.startswith("SLURM pending") for m in seen), seen


def slurm_ids(client: FtuneClient, job_id: str) -> list[str]:
    """Every SLURM job the service submitted for ``job_id`` (one per attempt)."""
    return [str(e["data"]["slurm_job_id"]) for e in client.events(job_id)
            if e["type"] == "slurm" and "submitted" in e["message"]]


def on_both_nodes(cluster: SlurmCluster, client: FtuneClient, job_id: str) -> bool:
    """A trainer rank of the job's latest SLURM job runs on every node."""
    ids = slurm_ids(client, job_id)
    return bool(ids) and all(cluster.rank_processes(n, ids[-1]) for n in cluster.node_names())


# From submit to rank 0's first step on both nodes. Fast here (~5-10 s), but every node
# starts `accelerate launch` (it imports torch), then the ranks meet over the bridge: on a
# 2-core machine under a full test suite each import can take tens of seconds.
RUN_TIMEOUT = 240.0


def wait_running_on_both_nodes(cluster: SlurmCluster, client: FtuneClient, job_id: str,
                               ready: Callable[[dict], bool] | None = None,
                               timeout: float = RUN_TIMEOUT) -> str:
    """Until the job's latest SLURM job is RUNNING with a trainer rank on every node and
    rank 0 has reported a step (and ``ready(job)``, if given): what a cancel, a scancel or
    a node failure must find for the test to mean anything. Returns the SLURM job id. Each
    stage's time is kept so that a timeout says which stage was slow."""
    t0 = time.monotonic()
    reached: dict[str, float] = {}

    def mark(stage: str, ok: bool) -> bool:
        if ok:
            reached.setdefault(stage, round(time.monotonic() - t0, 1))
        return ok

    def check() -> str | None:
        job = client.get_job(job_id)
        if job["status"] in ("succeeded", "failed", "cancelled"):
            raise AssertionError(f"the job ended {job['status']}: {job['error']}")
        ids = slurm_ids(client, job_id)
        if not mark("submitted", bool(ids)):
            return None
        if not mark("RUNNING", slurm_state(cluster, ids[-1]) == "RUNNING"):
            return None
        ranks = [mark(f"rank on {n}", bool(cluster.rank_processes(n, ids[-1])))
                 for n in cluster.node_names()]
        stepped = mark("first step", job["status"] == "running" and job["progress"]["step"] > 0)
        ok = all(ranks) and stepped and (ready is None or mark("ready", ready(job)))
        return ids[-1] if ok else None

    try:
        slurm_id = str(wait_until(check, timeout, "the job to run on both nodes"))
    except AssertionError as e:
        raise AssertionError(f"{e}; stages reached (s after the wait began): {reached}; "
                             f"job: {client.get_job(job_id)['status']}") from None
    print(f"job {job_id} runs on both nodes; stages (s): {reached}")  # shown with -s
    return slurm_id


def assert_no_process_left(cluster: SlurmCluster, client: FtuneClient, job_id: str) -> None:
    """No process of any of the job's SLURM jobs on any node (other jobs may be running)."""
    ids = slurm_ids(client, job_id)
    assert ids, "the job was never submitted to SLURM"

    def left() -> dict[str, list[str]]:
        found = {n: [p for i in ids for p in cluster.job_processes(n, i)]
                 for n in cluster.node_names()}
        return {n: ps for n, ps in found.items() if ps}

    try:
        wait_until(lambda: not left(), 20, "the job's processes to end on every node")
    except AssertionError:
        raise AssertionError(f"processes left on the nodes: {left()}") from None


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


def slurm_state(cluster: SlurmCluster, slurm_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", slurm_id, "-o", "%T"],
                         env=cluster_env(cluster), check=False, capture_output=True, text=True)
    return out.stdout.strip()


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


def cluster_env(cluster: SlurmCluster) -> dict[str, str]:
    import os

    return {**os.environ, **cluster.env}
