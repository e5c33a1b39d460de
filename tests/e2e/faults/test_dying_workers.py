"""Workers that die mid-run: SIGKILLed with their trainer running, or with every rank on
each attempt. The job is noticed lost by the other worker's reconciler, resumed from its
latest checkpoint, or failed worker_lost after its last attempt."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from client import FtuneClient
from testkit.faultstack import (
    FaultStack,
    launch_processes,
    sigkill,
)
from testkit.wait import wait_until
from tests.utils.faults import (
    DETECTION_BOUND,
    MAX_ATTEMPTS,
    ORPHAN_GRACE,
    assert_no_process_left,
    events,
    fake_spec,
    holder,
    job_dir,
    real_spec,
    trainer_step,
)

pytestmark = pytest.mark.e2e


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
