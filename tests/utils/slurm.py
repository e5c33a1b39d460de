"""The SLURM stack tests' helpers (tests/e2e/test_slurm.py, test_slurm_accounting.py): the
stack's environment on a cluster of testkit/slurm.py, and waits on a job's SLURM jobs and on
the ranks they run on each node."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from client import FtuneClient
from testkit.slurm import SlurmCluster
from testkit.wait import wait_until
from tests.utils.services import REDIS_URL
from tests.utils.specs import lm_spec

TWO_NODES = {"strategy": "ddp", "num_processes": 2, "num_machines": 2}


# What a requeued job says between its requeue and the pool's worker submitting it again to
# SLURM (seconds on a loaded machine): it waits for that worker.
BEFORE_SUBMIT = ("", "a worker of a pool with its own scheduler (SLURM) will submit it there")


# From submit to rank 0's first step on both nodes. Fast here (~5-10 s), but every node
# starts `accelerate launch` (it imports torch), then the ranks meet over the bridge: on a
# 2-core machine under a full test suite each import can take tens of seconds.
RUN_TIMEOUT = 240.0


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


def fake_spec(mode: str, model: Path, file_id: str, **training: object) -> dict:
    spec = lm_spec(model, file_id, **training)
    spec["name"] = f"fake:{mode}"
    spec["distributed"] = dict(TWO_NODES)
    return spec


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


def job_processes_with_env(cluster: SlurmCluster, node: str,
                           slurm_id: str) -> dict[str, bytes]:
    """Command line -> environment (/proc/<pid>/environ) of each process of SLURM job
    ``slurm_id`` on ``node`` (those whose environment names it)."""
    needle = f"SLURM_JOB_ID={slurm_id}".encode()
    found = {}
    for pid in cluster.pids_in(node):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found[f"{pid}: {cmd.strip()}"] = env
    return found


def grading_processes(seen: dict[str, bytes]) -> dict[str, bytes]:
    """The grading processes among a node's processes of a job (job_processes_with_env)."""
    return {c: e for c, e in seen.items() if " -m core.run.grading_process /" in c}


def trainer_step_processes(seen: dict[str, bytes]) -> dict[str, bytes]:
    """All but the judge key's holders (the grading step: its srun and grading process; the
    batch script that starts it): the trainer step's srun, the node's launcher, its ranks."""
    return {c: e for c, e in seen.items()
            if "core.run.grading_process" not in c and "slurm_script" not in c}


def rank_environs(seen: dict[str, bytes]) -> list[bytes]:
    """The environments of the trainer's ranks (torch elastic gives them RANK)."""
    return [e for e in trainer_step_processes(seen).values() if b"\0RANK=" in e]


def slurm_state(cluster: SlurmCluster, slurm_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", slurm_id, "-o", "%T"],
                         env=cluster_env(cluster), check=False, capture_output=True, text=True)
    return out.stdout.strip()


def cluster_env(cluster: SlurmCluster) -> dict[str, str]:
    return {**os.environ, **cluster.env}

