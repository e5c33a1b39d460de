"""Launching core.train on a job directory as the worker does (worker/run/prepare.py), for the
trainer tests (tests/utils/jobdirs.py) and bench/sharding_runs.py: the accelerate YAML from
the worker's generator, the env from launch_env, ``accelerate launch -m core.train <job>``."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def trainer_env() -> dict[str, str]:
    """This process's environment, offline, with the repository importable (first; what
    PYTHONPATH held stays after it: bench/gpu_run.sh puts the trainer's packages there)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *paths]),
        # Two CPU processes on two cores: one thread each, or they fight for the cores.
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    return env


def write_launch_files(
    job: Path, *, device: str = "cpu", env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """accelerate.yaml as the worker writes it (worker/run/prepare.py: the generator, the model's
    FSDP layer classes, the operator's cpu_fsdp2 from runtime); the argv and env it launches
    with (``env``, default trainer_env(), minus ACCELERATE_*/FSDP_*, plus launch_env)."""
    from core.policy import fsdp_layer_classes
    from core.spec import parse_job_spec
    from worker.run.accelerate_config import accelerate_config, launch_argv, launch_env, render_yaml

    body = json.loads((job / "spec.json").read_text())
    spec, runtime = parse_job_spec(body["spec"]), body["runtime"]
    layer_cls = None
    if spec.distributed.strategy == "fsdp":
        layer_cls = fsdp_layer_classes(
            runtime["model_path"], task=spec.model.task, fsdp_version=spec.distributed.fsdp.version
        )
    cfg = accelerate_config(
        spec, device=device, layer_cls=layer_cls, cpu_fsdp2=bool(runtime.get("cpu_fsdp2"))
    )
    (job / "accelerate.yaml").write_text(render_yaml(cfg))
    base = trainer_env() if env is None else env
    out = {k: v for k, v in base.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    out.update(launch_env(spec, device=device))
    return launch_argv(job), out
