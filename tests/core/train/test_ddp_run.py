"""Two real processes under ``accelerate launch`` (DDP on gloo, CPU)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.infra.ports import free_port
from testkit.wait import wait_until
from tests.utils.jobdirs import (
    REPO_ROOT,
    events,
    make_job,
    of_type,
    trainer_env,
    write_launch_files,
)
from tests.utils.tiny import text_rows


@pytest.mark.e2e
def test_two_process_ddp_run(tiny_causal_lm: Path, tmp_path: Path) -> None:
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(64),
        spec={"distributed": {"strategy": "ddp", "num_processes": 2},
              "tracking": {"report_to": ["tensorboard"]}},
        runtime={"tracking": {"report_to": ["tensorboard"]}},
    )
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate
    # Deliberately not the worker's launch (write_launch_files: YAML, ACCELERATE_USE_CPU),
    # which the other tests here and test_sharding_memory use: the trainer must also run
    # DDP under a plain `accelerate launch --multi_gpu` given by hand. On a CPU machine that
    # with runtime.device cpu runs DDP on gloo.
    cmd = [
        accelerate, "launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        "-m", "core.train", str(job),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        check=False,
        cwd=REPO_ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Both ranks exited well: none died in the process group's destructor at exit
    # (test_every_failing_rank_exits_with_its_own_status below).
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr

    evs = events(job)
    (started,) = of_type(evs, "started")
    assert started["world_size"] == 2
    assert started["strategy"] == "ddp"
    assert started["distributed_type"] == "MULTI_CPU"
    assert started["effective_batch_size"] == 8
    # Only rank 0 writes: one event per step, not two; memory reported for both ranks.
    assert [e["step"] for e in of_type(evs, "progress")] == list(range(1, 7))
    assert {(m["phase"], m["rank"]) for m in of_type(evs, "memory")} == {
        (p, r) for p in ("load", "train", "save") for r in (0, 1)
    }
    assert of_type(evs, "finished")[0]["step"] == 6
    # Tracking too: one run, from rank 0 (its logged values are already averaged over ranks).
    assert len(of_type(evs, "tracking")) == 1
    assert len(list((job / "tensorboard").glob("events.out.tfevents.*"))) == 1

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm)
    PeftModel.from_pretrained(base, job / "adapter")


@pytest.mark.e2e
def test_sigterm_to_one_rank_stops_both_at_the_same_step(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    """Only rank 1 is told to stop; rank 0 learns it through the per-step all-reduce. If the
    ranks disagreed, one would wait forever in the next gradient all-reduce."""
    import psutil

    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(64),
        spec={
            "distributed": {"strategy": "ddp", "num_processes": 2},
            "training": {"max_steps": 2000, "save_steps": 1000, "logging_steps": 50},
        },
    )
    argv, env = write_launch_files(job)  # as the worker launches it
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: [e for e in events(job) if e["type"] == "progress" and e["step"] >= 2],
                   180, "training to reach step 2", every=0.05,
                   give_up=lambda: proc.poll() is not None and "the launcher exited")
        rank1 = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "core.train" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1"
        ]
        assert len(rank1) == 1
        rank1[0].send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    assert "terminate called" not in stderr and "SIGABRT" not in stderr, stderr

    evs = events(job)
    (stopped,) = of_type(evs, "stopped")
    assert stopped["reason"] == "signal"
    step = stopped["step"]
    assert (job / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").is_file()
    # Both ranks saved their RNG state for this step: both reached the same checkpoint.
    assert (job / "checkpoints" / f"checkpoint-{step}" / "rng_state_1.pth").is_file()
    assert not (job / "adapter").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("attempt", [0, 1, 2])
def test_every_failing_rank_exits_with_its_own_status(
    attempt: int, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    """A rank that reaches exit with its gloo process group alive can die of SIGABRT after a
    good run (torch 2.13: "terminate called without an active exception"), and the launcher
    then reports the job as crashed. The trainer tears the group down on every path; several
    short failing runs, since on some machines this fails only now and then. The good path
    is test_two_process_ddp_run's, above: every other multi-process run of the suite also
    fails on such an exit (tests/utils/jobdirs.py's launch() wants status 0)."""
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(16),
        spec={
            "training": {"max_steps": 1, "save_steps": 100},
            "distributed": {"strategy": "ddp", "num_processes": 2},
        },
        # Fails after the process group exists: the data cannot be read.
        runtime={"train_path": str(tmp_path / "missing.jsonl")},
    )
    argv, env = write_launch_files(job)
    proc = subprocess.run(
        argv, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert json.loads((job / "error.json").read_text())["code"] == "invalid_dataset"
