"""Two real processes under ``accelerate launch`` (DDP on gloo, CPU)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.jobdirs import REPO_ROOT, events, make_job, of_type, trainer_env
from tests.utils.tiny import text_rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.e2e
def test_two_process_ddp_run(tiny_causal_lm: Path, tmp_path: Path) -> None:
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(64),
        spec={"distributed": {"strategy": "ddp", "num_processes": 2}},
    )
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate
    # On a CPU machine --multi_gpu with use_cpu=True (runtime.device cpu) runs DDP on gloo.
    cmd = [
        accelerate, "launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "core.train", str(job),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=trainer_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

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

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm)
    PeftModel.from_pretrained(base, job / "adapter")
