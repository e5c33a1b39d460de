"""A trainer whose parent dies (the worker or launcher was SIGKILLed) must not live on as an
orphan writing into the job directory (core/train/lifeline.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from core.run.jobdir import JobDir, read_events
from testkit.wait import wait_until
from tests.utils.worker import FAKE_TRAINER, subprocess_env

# The parent: starts the trainer, says its pid, then waits to be killed.
PARENT = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-m', sys.argv[1], sys.argv[2]])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _job_dir(root: Path, mode: str) -> JobDir:
    jd = JobDir(root / mode)
    jd.root.mkdir(parents=True)
    jd.spec.write_text(json.dumps({  # a run plan (core/run/plan.py) for the fake trainer
        "spec": {"name": f"fake:{mode}", "model": {"name_or_path": "org/m"},
                 "dataset": {"path": str(root / "train.jsonl")},
                 "training": {"max_steps": 100_000, "save_steps": 100_000}},
        "runtime": {"job_id": f"job-{mode}", "model_path": "org/m",
                    "train_path": str(root / "train.jsonl"), "attempt": 1,
                    "resume_from_checkpoint": None, "deadline": None},
    }))
    return jd


def _orphan(jd: JobDir, env: dict[str, str]) -> tuple[psutil.Process, float]:
    """Start parent -> trainer, wait until the trainer trains, SIGKILL the parent."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, FAKE_TRAINER, str(jd.root)],
                              stdout=subprocess.PIPE, env=env, text=True)
    assert parent.stdout is not None
    trainer = psutil.Process(int(parent.stdout.readline()))
    wait_until(lambda: any(e.get("type") in ("progress", "log") for _, e in read_events(jd.events)),
               30, "the trainer to start", every=0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait(5)
    return trainer, time.monotonic()


def test_orphaned_trainer_stops_gracefully_then_stubborn_one_is_hard_exited(
        tmp_path: Path) -> None:
    env = subprocess_env({"FTUNE_ORPHAN_GRACE_SECONDS": "1.5"})
    train, stubborn = _job_dir(tmp_path, "train"), _job_dir(tmp_path, "stubborn")
    t1, killed1 = _orphan(train, env)
    t2, killed2 = _orphan(stubborn, env)

    # The cooperative one stops at its next step and saves where it stopped...
    t1.wait(10)
    assert time.monotonic() - killed1 < 5
    stopped = [e for _, e in read_events(train.events) if e["type"] == "stopped"]
    assert stopped and stopped[0]["checkpoint"], "a graceful stop saves a checkpoint"
    assert train.latest_checkpoint() is not None
    # ...the one that ignores SIGTERM and STOP is hard-exited after the orphan grace.
    try:
        t2.wait(10)
        assert 1.0 < time.monotonic() - killed2 < 6
        assert not [e for _, e in read_events(stubborn.events) if e["type"] == "stopped"]
    finally:
        # Its sleeper children are not trainers (no lifeline): the worker's tree kill or the
        # reconciler's tag sweep handles those; here, the test cleans up.
        for pid in json.loads((stubborn.root / "pids.json").read_text())["tree"]:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
