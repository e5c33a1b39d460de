"""A real trainer run (tiny Llama + LoRA, one process on CPU, fixed seed) paused mid-run
through the worker and resumed: each step runs once, and the per-step losses equal those
of an uninterrupted run of the same spec.json."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from core.db.models import JobStatus, utcnow
from core.db.session import session_scope
from core.jobs import state as jobstate
from core.run.jobdir import JobDir, read_events
from tests.utils.specs import spec_body
from tests.utils.threads import act_when
from tests.utils.tiny import text_rows, write_jsonl
from tests.utils.worker import WorkerEnv, events_of, get_job, make_job, statuses
from worker.run import process_tree
from worker.run.local import run_job

pytestmark = pytest.mark.slow

# Enough steps that the pause lands mid-run even on an idle machine: the worker sees a
# pause within one watch poll (shortened below), the trainer stops at the next step.
STEPS = 100


def _spec(data: Path, model: Path) -> dict[str, Any]:
    return spec_body(
        model, task="causal_lm",
        dataset={"path": str(data), "format": "text", "max_seq_length": 32},
        # Dropout on: the resumed run must also restore the RNG state, not only the weights,
        # the optimizer, the scheduler and the data order.
        peft={"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.1},
        training={"max_steps": STEPS, "learning_rate": 5e-3, "per_device_train_batch_size": 2,
                  "logging_steps": 1, "save_steps": 1000, "seed": 0},
    )


def _losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["type"] == "progress" and "loss" in e}


def _uninterrupted(jd: JobDir, root: Path) -> dict[int, float]:
    """The same spec.json run once, start to end, by the trainer in this process."""
    from core.train.__main__ import main

    body = json.loads(jd.spec.read_text())
    body["runtime"].update(attempt=1, resume_from_checkpoint=None, deadline=None)
    ref = root / "reference"
    ref.mkdir()
    (ref / "spec.json").write_text(json.dumps(body))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main([str(ref)]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _losses([e for _, e in read_events(ref / "events.jsonl")])


def test_paused_and_resumed_run_has_the_losses_of_an_uninterrupted_one(
        tiny_causal_lm: Path, tmp_path: Path, configure, sqlite_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.run.watch

    monkeypatch.setattr(worker.run.watch, "POLL_SECONDS", 0.05)
    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train", FTUNE_CANCEL_GRACE_SECONDS="60")
    data = write_jsonl(w.data_root / "train.jsonl", text_rows(64))
    job_id = make_job(_spec(data, tiny_causal_lm))
    jd = JobDir(w.settings.jobs_dir / job_id)

    def pause(_: object) -> None:
        """POST /pause, as soon as the trainer wrote step 2 (read from its events file:
        sooner than waiting for the worker to ingest it)."""
        with session_scope() as s:
            assert jobstate.request_pause(s, job_id, previous=JobStatus.running, now=utcnow())

    t = act_when(lambda: any(e["type"] == "progress" and e["step"] >= 2
                             for _, e in read_events(jd.events)),
                 pause, 300, "the trainer to write step 2", every=0.01)
    assert run_job(job_id) == JobStatus.paused
    t.join()
    (stopped,) = events_of(job_id, "stopped")
    stop_step = stopped.data["step"]
    assert 2 <= stop_step < STEPS, "paused mid-run"
    assert process_tree.tagged_prefix(f"{job_id}:") == set()

    with session_scope() as s:
        assert jobstate.resume(s, job_id, now=utcnow())
    assert run_job(job_id) == JobStatus.succeeded

    started = events_of(job_id, "started")
    assert started[-1].data["resumed_from"] == f"checkpoints/checkpoint-{stop_step}"
    got = _losses([{"type": e.type, **e.data} for e in events_of(job_id, "progress")])
    assert sorted(got) == list(range(1, STEPS + 1))  # each step once: none redone or skipped
    assert got == _uninterrupted(jd, tmp_path)
    assert statuses(job_id) == ["running", "pausing", "paused", "queued", "running",
                                "succeeded"]
    job = get_job(job_id)
    assert (job.attempt, job.pauses, job.step) == (2, 1, STEPS)
