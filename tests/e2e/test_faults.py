"""Faults caused for real: a submitted job finishes or fails with a reason, exactly once,
whatever crashes.

One stack for the module (testkit/faultstack.py): the API and two Celery workers as
processes, a PostgreSQL database and a redis-server (no persistence) of its own, short
heartbeats. Workers run tests.worker.fault_trainer: the real core.train with a fault
injected (jobs named ``fault:<kind>``), or the fake trainer (jobs named ``fake:<mode>``).
Workers, trainer ranks, Redis and the API are SIGKILLed; messages are flushed, duplicated
and outlive the visibility timeout; jobs are cancelled in each phase.
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import FtuneClient
from testkit.faultstack import (
    FaultStack,
    PgDatabase,
    RedisServer,
    launch_processes,
    send_run_job,
    sigkill,
)
from testkit.wait import wait_until
from tests.utils.specs import spec_body
from tests.utils.tiny import text_rows, write_jsonl

pytestmark = pytest.mark.e2e

HEARTBEAT_TIMEOUT = 4.0
RECONCILE_INTERVAL = 1.0
GRACE = 3.0
ORPHAN_GRACE = max(1.0, min(GRACE, HEARTBEAT_TIMEOUT / 2))  # what the worker gives the trainer
MAX_ATTEMPTS = 2
# A lost worker is noticed after the heartbeat timeout, by the next reconciler pass (every
# interval, +-20% jitter); a second of slack for a loaded machine.
DETECTION_BOUND = HEARTBEAT_TIMEOUT + 1.2 * RECONCILE_INTERVAL + 0.5 + 3.0
QUEUE = "ftune.faults"
TERMINAL = ("succeeded", "failed", "cancelled")


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def database() -> Iterator[PgDatabase]:
    db = PgDatabase().create()
    yield db
    db.drop()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("datasets")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer,
          database: PgDatabase, models_dir: Path, tiny_causal_lm: Path,
          data_root: Path) -> Iterator[FaultStack]:
    st = FaultStack(
        data_dir=tmp_path_factory.mktemp("faults"),
        workers=2,
        env_overrides={
            "DATABASE_URL": database.url,
            "BROKER_URL": redis_server.url,
            "FTUNE_QUEUE_NAME": QUEUE,
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
            "FTUNE_ALLOWED_DATA_ROOTS": str(data_root),
            "FTUNE_TRAINER_MODULE": "tests.worker.fault_trainer",
            "FTUNE_WORKER_GPUS": "0",
            "FTUNE_HEARTBEAT_SECONDS": "0.5",
            "FTUNE_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT),
            "FTUNE_RECONCILE_INTERVAL_SECONDS": str(RECONCILE_INTERVAL),
            "FTUNE_QUEUED_REQUEUE_SECONDS": "3",
            "FTUNE_CANCEL_GRACE_SECONDS": str(GRACE),
            "FTUNE_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "FTUNE_JOBS_PER_MINUTE_PER_TENANT": "100000",
            # A visibility timeout far shorter than the runs, swept every second: a message
            # left unacked while its job runs would be delivered again within seconds.
            "FTUNE_BROKER_TRANSPORT_OPTIONS": json.dumps({
                "visibility_timeout": 2, "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1}),
        },
    )
    st.start()
    yield st
    st.stop()


@pytest.fixture
def client(stack: FaultStack) -> Iterator[FtuneClient]:
    # Restore what a failed test may have left down.
    for i in range(stack.workers):
        if stack.worker_pid(i) is None:
            stack.start_worker(i)
    with FtuneClient(stack.url, stack.api_key) as c:
        yield c


@pytest.fixture(scope="module")
def lm_file(stack: FaultStack, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = write_jsonl(tmp_path_factory.mktemp("upload") / "train.jsonl", text_rows(64))
    with FtuneClient(stack.url, stack.api_key) as c:
        return c.upload_file(path)["id"]


# ------------------------------------------------------------------------------- helpers


def fake_spec(model: Path, file_id: str, mode: str, label: str = "",
              **training: Any) -> dict[str, Any]:
    return {"name": f"fake:{mode}" + (f":{label}" if label else ""),
            **spec_body(model, task="causal_lm",
                        dataset={"file_id": file_id, "format": "text", "max_seq_length": 32},
                        training=training or {"max_steps": 20})}


def real_spec(model: Path, dataset: dict[str, Any], fault: str, **training: Any) -> dict[str, Any]:
    return {"name": f"fault:{fault}",
            **spec_body(model, task="causal_lm",
                        dataset={"format": "text", "max_seq_length": 32, **dataset},
                        peft={"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
                        training={"max_steps": 6, "learning_rate": 5e-3,
                                  "per_device_train_batch_size": 4, "logging_steps": 1,
                                  "save_steps": 2, "seed": 0, **training})}


def events(c: FtuneClient, job_id: str, type_: str | None = None) -> list[dict[str, Any]]:
    evs = c.events(job_id, limit=1000)
    return [e for e in evs if type_ is None or e["type"] == type_]


def holder(c: FtuneClient, job_id: str) -> str:
    """The worker_id of the job's latest claim (from its "running" status event)."""
    running = [e for e in events(c, job_id, "status") if e["data"].get("status") == "running"]
    return str(running[-1]["data"]["worker_id"])


def job_dir(stack: FaultStack, job_id: str) -> Path:
    return stack.data_dir / "jobs" / job_id


def trainer_step(jd: Path) -> int:
    """The last step the trainer reported in events.jsonl (the DB lags by a poll)."""
    from core.run.jobdir import read_events

    steps = [e["step"] for _, e in read_events(jd / "events.jsonl") if e["type"] == "progress"]
    return max(steps, default=0)


def assert_no_process_left(job_id: str, timeout: float = 10.0) -> None:
    wait_until(lambda: not launch_processes(job_id), timeout,
               f"every process of job {job_id} to be gone")


def wait_all(c: FtuneClient, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    jobs: dict[str, dict[str, Any]] = {}

    def done() -> bool:
        for i in ids:
            if i not in jobs or jobs[i]["status"] not in TERMINAL:
                jobs[i] = c.get_job(i)
        return all(j["status"] in TERMINAL for j in jobs.values())

    wait_until(done, timeout, f"jobs to finish: {ids}", every=0.5)
    return jobs


def log_count(stack: FaultStack, needle: str) -> int:
    return sum(stack.worker_log(i).read_text(errors="replace").count(needle)
               for i in range(stack.workers) if stack.worker_log(i).exists())


def block_workers(c: FtuneClient, model: Path, file_id: str, stack: FaultStack) -> list[str]:
    """Occupy both workers with jobs that "load the model" until cancelled."""
    ids = [c.create_job(fake_spec(model, file_id, "slow_load", f"b{i}"))["id"]
           for i in range(stack.workers)]
    wait_until(lambda: all(events(c, i, "log") for i in ids), 60, "both workers busy loading")
    return ids


def release(c: FtuneClient, blockers: list[str]) -> None:
    """Cancel while the model loads: cancelled, and nothing of theirs left running."""
    for b in blockers:
        assert c.cancel_job(b)["status"] == "cancelling"
    for b, job in wait_all(c, blockers, 30).items():
        assert job["status"] == "cancelled", job
        assert events(c, b, "stopped"), "stopped gracefully, before any step"
        assert_no_process_left(b)


# ----------------------------------------------------------------- 1. workers that die


def test_worker_sigkilled_mid_training_real_trainer_resumes_on_the_other_worker(
        stack: FaultStack, client: FtuneClient, tiny_causal_lm: Path, lm_file: str,
        tmp_path: Path) -> None:
    """The real trainer on a tiny LLaMA, checkpoints every 4 steps. Its worker is SIGKILLed:
    the orphaned rank exits by itself, the other worker's reconciler requeues the job, and
    attempt 2 resumes from the latest checkpoint and finishes at exactly max_steps."""
    from transformers import AutoModelForCausalLM

    from tests.e2e.test_stack import assert_adapter_loads

    spec = real_spec(tiny_causal_lm, {"file_id": lm_file}, "slow", max_steps=16, save_steps=4)
    job_id = client.create_job(spec)["id"]
    jd = job_dir(stack, job_id)
    wait_until(lambda: trainer_step(jd) >= 5, 180, "step 5")  # from the file: no lag
    assert (jd / "checkpoints" / "checkpoint-4" / "trainer_state.json").exists()
    victim = stack.worker_index(holder(client, job_id))
    assert launch_processes(job_id, 1), "the launcher and its rank run"

    stack.kill_worker(victim)
    killed = time.monotonic()
    try:
        # The launcher dies with its worker (PDEATHSIG); its orphaned rank notices, stops at
        # the next step and exits within the orphan grace: no process of attempt 1 is left.
        wait_until(lambda: not launch_processes(job_id, 1), ORPHAN_GRACE + 5,
                   "the orphaned trainer to exit")
        orphan_gone = time.monotonic() - killed
        wait_until(lambda: events(client, job_id, "requeued"), DETECTION_BOUND + 5, "requeue")
        detected = time.monotonic() - killed
        job = client.wait(job_id, timeout=240, poll_seconds=0.5)
    finally:
        stack.start_worker(victim)

    assert job["status"] == "succeeded", job["error"]
    assert job["attempt"] == 2
    assert orphan_gone <= ORPHAN_GRACE + 5
    assert detected <= DETECTION_BOUND, f"lost job noticed after {detected:.1f} s"
    requeued = events(client, job_id, "requeued")
    assert len(requeued) == 1 and "lost" in requeued[0]["message"]
    # Attempt 2 ran on the other worker, from the newest checkpoint (the orphan may have saved
    # one more when it stopped), and only the steps after it.
    assert stack.worker_index(holder(client, job_id)) != victim
    started = events(client, job_id, "started")
    assert [s["data"]["attempt"] for s in started] == [1, 2]
    assert started[0]["data"]["resumed_from"] is None
    resumed = started[1]["data"]["resumed_from"]
    assert resumed and resumed.startswith("checkpoints/checkpoint-")
    from_step = int(resumed.rsplit("-", 1)[1])
    assert 4 <= from_step < 16
    all_events = events(client, job_id)
    second = next(i for i, e in enumerate(all_events)
                  if e["type"] == "started" and e["data"]["attempt"] == 2)
    steps2 = [e["data"]["step"] for e in all_events[second:] if e["type"] == "progress"]
    assert steps2[0] == from_step + 1 and steps2[-1] == 16
    # No double counting: the job ends at max_steps, and so does the trainer's own state.
    assert job["progress"]["step"] == job["progress"]["total_steps"] == 16
    state = json.loads((jd / "checkpoints" / "checkpoint-16" / "trainer_state.json").read_text())
    assert state["global_step"] == 16
    assert_no_process_left(job_id)
    assert_adapter_loads(client, job_id, tiny_causal_lm, tmp_path, AutoModelForCausalLM)


def test_worker_and_ranks_sigkilled_on_every_attempt_fails_worker_lost(
        stack: FaultStack, client: FtuneClient, tiny_causal_lm: Path, lm_file: str) -> None:
    """Kill the worker and every trainer process at once, on each attempt: attempt 2 resumes
    from attempt 1's checkpoint; after MAX_ATTEMPTS the job fails worker_lost."""
    job_id = client.create_job(
        fake_spec(tiny_causal_lm, lm_file, "train", max_steps=100_000, save_steps=4))["id"]
    lost_after: list[float] = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        def training(attempt: int = attempt) -> bool:
            j = client.get_job(job_id)
            return (j["status"] == "running" and j["attempt"] == attempt
                    and j["progress"]["step"] >= 6
                    and len(events(client, job_id, "started")) == attempt)

        wait_until(training, 60, f"attempt {attempt} to train")
        victim = stack.worker_index(holder(client, job_id))
        procs = launch_processes(job_id, attempt)
        assert procs
        stack.kill_worker(victim)
        sigkill(procs)
        killed = time.monotonic()
        if attempt < MAX_ATTEMPTS:
            wait_until(lambda n=attempt: len(events(client, job_id, "requeued")) == n,
                       DETECTION_BOUND + 5, "requeue")
            lost_after.append(time.monotonic() - killed)
        # A live worker to pick up the job, or to declare it lost.
        stack.start_worker(victim)

    job = client.wait(job_id, timeout=DETECTION_BOUND + 10, poll_seconds=0.3)
    lost_after.append(time.monotonic() - killed)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "worker_lost"
    assert f"attempt {MAX_ATTEMPTS} of {MAX_ATTEMPTS}" in job["error"]["message"]
    assert job["attempt"] == MAX_ATTEMPTS
    assert all(t <= DETECTION_BOUND + 5 for t in lost_after), lost_after
    started = events(client, job_id, "started")
    assert [s["data"]["attempt"] for s in started] == [1, 2]
    assert started[1]["data"]["resumed_from"].startswith("checkpoints/checkpoint-")
    assert_no_process_left(job_id)


# ----------------------------------------------------------------------- 2. the broker


def test_messages_lost_by_redis_flushall_and_restart_are_sent_again(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        tiny_causal_lm: Path, lm_file: str) -> None:
    r = redis_server.client()
    busy = [client.create_job(fake_spec(tiny_causal_lm, lm_file, "train", f"busy{i}",
                                        max_steps=15))["id"] for i in range(2)]
    wait_until(lambda: all(client.get_job(b)["status"] == "running" for b in busy), 60,
               "both workers busy")
    flushed = [client.create_job(fake_spec(tiny_causal_lm, lm_file, "succeed", "flushed"))["id"]]
    assert r.llen(QUEUE) >= 1
    redis_server.flushall()
    assert r.llen(QUEUE) == 0
    crashed = [client.create_job(fake_spec(tiny_causal_lm, lm_file, "succeed", "crashed"))["id"]]
    assert r.llen(QUEUE) >= 1
    redis_server.restart()  # SIGKILL, no persistence: an empty broker comes back
    assert redis_server.client().llen(QUEUE) == 0

    jobs = wait_all(client, busy + flushed + crashed, 90)
    assert {j["status"] for j in jobs.values()} == {"succeeded"}, jobs
    assert {j["attempt"] for j in jobs.values()} == {1}
    for job_id in flushed + crashed:
        resent = [e for e in events(client, job_id, "requeued")
                  if e["data"].get("reason") == "queued_timeout"]
        assert resent, f"{job_id} ran without the reconciler sending it again?"
        assert len(events(client, job_id, "started")) == 1
    assert stack.alive_workers() == [0, 1], "the workers rode out the Redis restart"


def test_a_message_delivered_three_times_starts_one_run(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        tiny_causal_lm: Path, lm_file: str) -> None:
    job_id = client.create_job(fake_spec(tiny_causal_lm, lm_file, "train", max_steps=8))["id"]
    send_run_job(redis_server.url, job_id, 2, queue=QUEUE)  # both workers get one at the same time

    job = client.wait(job_id, timeout=60, poll_seconds=0.3)
    assert job["status"] == "succeeded" and job["attempt"] == 1
    assert len(events(client, job_id, "started")) == 1
    running = [e for e in events(client, job_id, "status") if e["data"]["status"] == "running"]
    assert len(running) == 1
    wait_until(lambda: log_count(stack, f"job {job_id} is ") >= 2, 20, "both duplicates seen")
    assert log_count(stack, f"job {job_id}: claimed attempt") == 1


def test_a_run_longer_than_the_visibility_timeout_is_delivered_once(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        tiny_causal_lm: Path, lm_file: str) -> None:
    """visibility_timeout is 2 s, swept every second; the run takes ~9 s. Messages are acked
    on receipt, so nothing of this job is left unacked to come back. Control: an unacked
    message planted in the same Redis *is* given back and delivered by these workers."""
    r = redis_server.client()
    job_id = client.create_job(fake_spec(tiny_causal_lm, lm_file, "train", max_steps=25))["id"]
    wait_until(lambda: client.get_job(job_id)["status"] == "running", 60, "running")
    planted = plant_unacked(redis_server, f"job-planted-{secrets.token_hex(3)}")

    seen_unacked: list[bytes] = []
    while (status := client.get_job(job_id)["status"]) not in TERMINAL:
        seen_unacked += [v for v in r.hvals("unacked") if job_id.encode() in v]
        time.sleep(0.2)
    assert status == "succeeded"
    job = client.get_job(job_id)
    run_seconds = (_ts(job["finished_at"]) - _ts(job["started_at"]))
    assert run_seconds > 3 * 2, "the run must outlast the visibility timeout several times"
    assert seen_unacked == [], "the job's message was left unacked while it ran"
    wait_until(lambda: log_count(stack, f"job {planted}: no such job") >= 1, 15,
               "the planted unacked message to be restored and delivered (control)")
    assert job["attempt"] == 1 and len(events(client, job_id, "started")) == 1
    assert log_count(stack, f"job {job_id}: claimed attempt") == 1
    assert log_count(stack, f"job {job_id} is ") == 0, "delivered again"


def _ts(s: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(s).timestamp()


def plant_unacked(redis_server: RedisServer, job_id: str) -> str:
    """What kombu leaves in Redis for a message delivered but not acked (its worker died
    before acking): the payload under "unacked" and its delivery time in "unacked_index",
    here 100 s in the past."""
    from celery import Celery

    parking = f"parking-{secrets.token_hex(3)}"
    app = Celery("plant", broker=redis_server.url)
    try:
        app.send_task("ftune.run_job", args=[job_id], queue=parking)
    finally:
        app.close()
    r = redis_server.client()
    raw = r.lpop(parking)
    payload = json.loads(raw)
    tag = payload["properties"]["delivery_tag"]
    r.hset("unacked", tag, json.dumps([payload, "", QUEUE]))
    r.zadd("unacked_index", {tag: time.time() - 100})
    return job_id


def test_api_killed_during_submissions_retried_keys_make_one_job_each(
        stack: FaultStack, client: FtuneClient, database: PgDatabase,
        tiny_causal_lm: Path, lm_file: str) -> None:
    from sqlalchemy import create_engine, text

    label = secrets.token_hex(4)
    spec = fake_spec(tiny_causal_lm, lm_file, "succeed", label)
    keys = [f"{label}-{i}" for i in range(24)]
    answered: dict[str, str] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def submit(my_keys: list[str]) -> None:
        with httpx.Client(base_url=stack.url, timeout=5,
                          headers={"Authorization": f"Bearer {stack.api_key}"}) as http:
            for k in my_keys:
                try:
                    resp = http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": k})
                    resp.raise_for_status()
                    with lock:
                        answered[k] = resp.json()["id"]
                except httpx.HTTPError as e:
                    with lock:
                        errors.append(f"{k}: {type(e).__name__}")
                time.sleep(0.05)

    threads = [threading.Thread(target=submit, args=(keys[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(answered) >= 6, 30, "some submissions")
    stack.kill_api()  # mid-stream: requests in flight die with it
    for t in threads:
        t.join()
    stack.start_api()

    final: dict[str, str] = {}
    for k in keys:  # every client retries with its key
        final[k] = client.create_job(spec, idempotency_key=k)["id"]
    assert errors, "the API died before every request was answered"
    assert all(final[k] == answered[k] for k in answered), "a retry made a second job"
    engine = create_engine(database.url)
    try:
        with engine.connect() as conn:
            n, n_keys = conn.execute(text(
                "SELECT count(*), count(DISTINCT idempotency_key) FROM jobs WHERE name = :n"),
                {"n": spec["name"]}).one()
    finally:
        engine.dispose()
    assert n == n_keys == len(keys) == len(set(final.values()))
    for job_id in set(final.values()):  # the workers need not run them all
        client.cancel_job(job_id)
    wait_all(client, list(set(final.values())), 60)


# ------------------------------------------------------------- 3. cancel and time limits


def test_jobs_queued_behind_busy_workers_cancelled_or_changed_inputs(
        stack: FaultStack, client: FtuneClient, tiny_causal_lm: Path, models_dir: Path,
        database: PgDatabase, lm_file: str, tmp_path: Path) -> None:
    """Both workers busy loading a model; meanwhile one queued job is cancelled, and two
    that were valid when submitted lose their input before they run: the uploaded file is
    modified in storage, the model directory is deleted. Then the loading jobs are cancelled
    (cancel during model load)."""
    from sqlalchemy import create_engine, text

    upload_id = client.upload_file(write_jsonl(tmp_path / "u.jsonl", text_rows(32)))["id"]
    doomed = models_dir / f"doomed-{secrets.token_hex(3)}"
    shutil.copytree(tiny_causal_lm, doomed)

    blockers = block_workers(client, tiny_causal_lm, lm_file, stack)
    queued = client.create_job(fake_spec(tiny_causal_lm, lm_file, "succeed", "queued"))["id"]
    assert client.cancel_job(queued)["status"] == "cancelled"
    changed_file = client.create_job(real_spec(tiny_causal_lm, {"file_id": upload_id},
                                               "none"))["id"]
    no_model = client.create_job(real_spec(doomed, {"file_id": lm_file}, "none"))["id"]
    engine = create_engine(database.url)
    try:
        with engine.connect() as conn:
            stored = Path(conn.execute(text("SELECT storage_path FROM files WHERE id = :i"),
                                       {"i": upload_id}).scalar_one())
    finally:
        engine.dispose()
    with open(stored, "a") as f:
        f.write('{"text": "appended after the upload was validated"}\n')
    shutil.rmtree(doomed)

    release(client, blockers)
    jobs = wait_all(client, [changed_file, no_model], 60)
    assert jobs[changed_file]["error"]["code"] == "invalid_dataset"
    assert "changed in storage since it was uploaded" in jobs[changed_file]["error"]["message"]
    assert jobs[no_model]["error"]["code"] == "model_not_found"
    for job_id in (changed_file, no_model):  # refused before any process started
        assert not (job_dir(stack, job_id) / "trainer.log").exists()
    job = client.get_job(queued)  # its message was delivered too: the claim refused it
    assert job["status"] == "cancelled" and job["attempt"] == 0
    assert [e["data"]["status"] for e in events(client, queued, "status")] == \
        ["queued", "cancelled"]
    assert not job_dir(stack, queued).exists(), "never started"


def test_cancel_during_training_saves_a_checkpoint_and_during_save_is_killed(
        stack: FaultStack, client: FtuneClient, tiny_causal_lm: Path, lm_file: str) -> None:
    training = client.create_job(fake_spec(tiny_causal_lm, lm_file, "train",
                                           max_steps=100_000, save_steps=100_000))["id"]
    saving = client.create_job(fake_spec(tiny_causal_lm, lm_file, "slow_save"))["id"]
    wait_until(lambda: client.get_job(training)["progress"]["step"] >= 3, 60, "training")
    wait_until(lambda: any("saving" in e["message"] for e in events(client, saving, "log")),
               60, "saving")
    asked = time.monotonic()
    client.cancel_job(training)
    client.cancel_job(saving)
    jobs = wait_all(client, [training, saving], GRACE + 20)
    took = time.monotonic() - asked

    assert jobs[training]["status"] == jobs[saving]["status"] == "cancelled"
    (stopped,) = events(client, training, "stopped")
    assert stopped["data"]["checkpoint"], "the graceful stop saved where it stopped"
    assert [c["step"] for c in client.checkpoints(training)] == [stopped["data"]["step"]]
    # The save ignores the stop: SIGKILLed after the grace period, not waited for.
    assert not events(client, saving, "stopped") and not jobs[saving]["adapter_available"]
    assert took < GRACE + 10
    for job_id in (training, saving):
        assert_no_process_left(job_id)
        pids = json.loads((job_dir(stack, job_id) / "pids.json").read_text())
        assert not _alive([pids["trainer"], *pids["tree"]])


def _alive(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def test_job_past_its_timeout_fails_with_timeout(
        stack: FaultStack, client: FtuneClient, tiny_causal_lm: Path, lm_file: str) -> None:
    spec = fake_spec(tiny_causal_lm, lm_file, "train", max_steps=100_000, save_steps=100_000)
    spec["resources"] = {"timeout_seconds": 8}  # the clock starts at the claim
    job = client.wait(client.create_job(spec)["id"], timeout=60, poll_seconds=0.3)
    assert job["status"] == "failed" and job["error"]["code"] == "timeout"
    assert "8 s" in job["error"]["message"]
    assert job["progress"]["step"] > 0, "it trained until the deadline"
    assert _ts(job["finished_at"]) - _ts(job["started_at"]) < 8 + GRACE + 5
    assert_no_process_left(job["id"])


# ---------------------------------------------------------- 4. trainer failures, classified


def test_trainer_failures_end_with_their_code_and_the_log_tail(
        stack: FaultStack, client: FtuneClient, tiny_causal_lm: Path, lm_file: str) -> None:
    """The real trainer with a fault injected: out of memory, a NaN loss, a full disk at the
    first checkpoint, and rank 1 of a 2-process DDP run dying at step 2 (rank 0 must not
    hang in its next collective)."""
    ds = {"file_id": lm_file}
    ids = {
        "out_of_memory": client.create_job(real_spec(tiny_causal_lm, ds, "oom"))["id"],
        "nan_loss": client.create_job(real_spec(tiny_causal_lm, ds, "nan"))["id"],
        "disk_full": client.create_job(real_spec(tiny_causal_lm, ds, "disk_full"))["id"],
    }
    ddp = real_spec(tiny_causal_lm, ds, "rank_crash", max_steps=20, save_steps=100)
    ddp["distributed"] = {"strategy": "ddp", "num_processes": 2}
    ids["trainer_crashed"] = client.create_job(ddp)["id"]

    jobs = wait_all(client, list(ids.values()), 300)
    for code, job_id in ids.items():
        job = jobs[job_id]
        assert job["status"] == "failed", (code, job)
        assert job["error"]["code"] == code, job["error"]
        tail = [e for e in events(client, job_id, "log") if "trainer.log" in e["message"]]
        assert tail and tail[0]["data"]["lines"], f"{code}: no log tail"
        assert not job["adapter_available"]
        assert_no_process_left(job_id)
    assert "out of memory" in jobs[ids["out_of_memory"]]["error"]["message"]
    assert "non-finite" in jobs[ids["nan_loss"]]["error"]["message"]
    assert "disk is full" in jobs[ids["disk_full"]]["error"]["message"]
    crash = jobs[ids["trainer_crashed"]]
    assert "rank 1 failed first (exit code 1" in crash["error"]["message"]
    tail = next(e for e in events(client, ids["trainer_crashed"], "log")
                if "trainer.log" in e["message"])
    assert any("rank 1 dies now" in line or "Root Cause" in line for line in tail["data"]["lines"])
    started = events(client, ids["trainer_crashed"], "started")
    assert started and started[0]["data"]["world_size"] == 2
    # Torn down as soon as rank 1 died, not after some collective timeout.
    last_progress = _ts(events(client, ids["trainer_crashed"], "progress")[-1]["created_at"])
    assert _ts(crash["finished_at"]) - last_progress < 30


# -------------------------------------------------------------------------- 5. secrets


def test_no_secret_reaches_a_log_or_the_trainer(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        database: PgDatabase, tiny_causal_lm: Path, lm_file: str) -> None:
    """Runs last: every log of this module's faults is checked for the credentials."""
    job = client.wait(client.create_job(fake_spec(tiny_causal_lm, lm_file, "env"))["id"],
                      timeout=60, poll_seconds=0.3)
    assert job["status"] == "succeeded", job["error"]
    env = json.loads((job_dir(stack, job["id"]) / "env.json").read_text())
    secrets_ = {"database password": database.password, "redis password": redis_server.password,
                "API key": stack.api_key}
    for what, value in secrets_.items():
        assert not [k for k, v in env.items() if value in v], f"{what} in the trainer's env"
    assert not {"DATABASE_URL", "BROKER_URL", "FTUNE_BOOTSTRAP_API_KEY"} & set(env)

    logs = stack.log_text()
    trainer_logs = "\n".join(p.read_text(errors="replace")
                             for p in (stack.data_dir / "jobs").glob("*/trainer.log"))
    for what, value in secrets_.items():
        assert value not in logs, f"{what} in a service log"
        assert value not in trainer_logs, f"{what} in a trainer log"
    assert "ftune worker ready: database postgresql+psycopg://postgres:***@" in logs
    assert f"redis://:***@127.0.0.1:{redis_server.port}/0" in logs
