"""Graceful stop (STOP file, SIGTERM, deadline) and resuming from the checkpoint it leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from testkit.wait import wait_until
from tests.utils.jobdirs import REPO_ROOT, events, make_job, of_type, trainer_env
from tests.utils.tiny import text_rows

LONG = {"training": {"max_steps": 2000, "save_steps": 1000, "logging_steps": 50}}


def _wait_for_step(job: Path, step: int, timeout: float = 120) -> None:
    wait_until(lambda: any(e["step"] >= step for e in of_type(events(job), "progress")),
               timeout, f"a progress event for step {step}", every=0.02)


def _assert_stopped_with_checkpoint(job: Path, reason: str) -> int:
    evs = events(job)
    (stopped,) = of_type(evs, "stopped")
    assert stopped["reason"] == reason
    step = stopped["step"]
    assert 2 <= step < 2000
    (ckpt,) = of_type(evs, "checkpoint")
    assert ckpt["step"] == step
    assert stopped["checkpoint"] == ckpt["path"] == f"checkpoints/checkpoint-{step}"
    assert (job / ckpt["path"] / "trainer_state.json").is_file()
    assert not (job / "adapter").exists() and not (job / "adapter.tmp").exists()
    assert not of_type(evs, "finished") and not of_type(evs, "saved")
    assert not (job / "error.json").exists()
    return step


def test_stop_file_saves_a_checkpoint_and_exits_zero(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(tmp_path, tiny_causal_lm, text_rows(64), spec=LONG)

    def worker_asks_to_stop() -> None:
        _wait_for_step(job, 2)
        (job / "STOP").touch()

    watcher = threading.Thread(target=worker_asks_to_stop, daemon=True)
    watcher.start()
    assert run_main(job) == 0
    watcher.join(timeout=5)
    _assert_stopped_with_checkpoint(job, "stop_file")


def test_sigterm_saves_a_checkpoint_and_exits_zero(tiny_causal_lm: Path, tmp_path: Path) -> None:
    job = make_job(tmp_path, tiny_causal_lm, text_rows(64), spec=LONG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.train", str(job)],
        cwd=REPO_ROOT,
        env=trainer_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_step(job, 2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    _assert_stopped_with_checkpoint(job, "signal")


def test_past_deadline_stops_before_training(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(tmp_path, tiny_causal_lm, text_rows(16), runtime={"deadline": time.time() - 1})
    assert run_main(job) == 0
    evs = events(job)
    (stopped,) = of_type(evs, "stopped")
    assert (stopped["reason"], stopped["step"]) == ("timeout", 0)
    assert not of_type(evs, "progress") and not (job / "adapter").exists()


def test_resume_continues_the_step_count(
    tiny_causal_lm: Path,
    tmp_path: Path,
    run_main: Callable[[Path], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from core.train.callbacks import JobCallback

    # Attempt 1 is stopped at step 3, deterministically: the STOP file appears during step 3.
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(64),
        spec={"training": {"max_steps": 8, "save_steps": 100}},
    )
    original = JobCallback.on_step_end

    def stop_at_3(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == 3:
            (job / "STOP").touch()
        return original(self, args, state, control, **kw)

    monkeypatch.setattr(JobCallback, "on_step_end", stop_at_3)
    assert run_main(job) == 0
    monkeypatch.setattr(JobCallback, "on_step_end", original)
    (stopped,) = of_type(events(job), "stopped")
    assert stopped["step"] == 3

    # Attempt 2, as the worker would launch it: STOP removed, resume from the checkpoint.
    (job / "STOP").unlink()
    body = json.loads((job / "spec.json").read_text())
    body["runtime"].update(
        attempt=2, resume_from_checkpoint=str(job / "checkpoints" / "checkpoint-3")
    )
    (job / "spec.json").write_text(json.dumps(body))
    first_run_events = len(events(job))
    assert run_main(job) == 0

    evs = events(job)[first_run_events:]
    (started,) = of_type(evs, "started")
    assert started["initial_step"] == 3 and started["total_steps"] == 8
    assert started["resumed_from"] == "checkpoints/checkpoint-3"
    assert [e["step"] for e in of_type(evs, "progress")] == [4, 5, 6, 7, 8]
    (finished,) = of_type(evs, "finished")
    assert finished["step"] == 8
    assert (job / "adapter" / "adapter_model.safetensors").is_file()
    assert os.path.isdir(job / "checkpoints" / "checkpoint-8")
