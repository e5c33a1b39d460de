"""The serving stack the e2e modules share (tests/e2e/test_serving.py,
tests/e2e/test_evals_deployments.py): uvicorn and one Celery worker whose serving supervisor
launches vLLM's CPU server in its own process tree, a tiny Llama in the catalog as a LoRA
base (BASE) and as a full fine-tune's base (FULL). Session-scoped and registered once (in
tests/e2e/conftest.py), so the modules that use it start one stack and one engine between
them: an engine start costs 30-90 s on these machines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from testkit.faultstack import FaultStack
from testkit.vllm_server import build_served_llama

BASE = "tiny-serve"
FULL = "tiny-serve-full"  # the same model, fine-tuned whole (peft method full)
MAX_LORAS = 2
IDLE_SECONDS = 45


@pytest.fixture(scope="session")
def servable_lm(models_dir: Path) -> Path:
    """A tiny Llama vLLM's CPU attention accepts (head_dim 64; it refuses below 32)."""
    return build_served_llama(models_dir / "tiny-llama-serve")


@pytest.fixture(scope="session")
def serving_stack(tmp_path_factory: pytest.TempPathFactory,
                  servable_lm: Path) -> Iterator[FaultStack]:
    data_dir = tmp_path_factory.mktemp("serving")
    catalog = {BASE: {"location": str(servable_lm), "max_seq_length": 48,
                      "learning_rate": 1e-2,
                      "peft": {"method": "lora", "r": 8, "lora_alpha": 16,
                               "target_modules": "all-linear"}},
               FULL: {"location": str(servable_lm), "max_seq_length": 48,
                      "learning_rate": 1e-3, "peft": {"method": "full"}}}
    st = FaultStack(data_dir=data_dir, workers=1, env_overrides={
        "DATABASE_URL": f"sqlite:///{data_dir / 'ftune.db'}",
        "BROKER_URL": "filesystem://",
        "FTUNE_ALLOWED_MODEL_ROOTS": str(servable_lm.parent),
        "FTUNE_MODEL_CATALOG": json.dumps(catalog),
        "FTUNE_WORKER_GPUS": "0",
        "FTUNE_HEARTBEAT_SECONDS": "0.5",
        "FTUNE_SERVING_MAX_LORAS": str(MAX_LORAS),
        "FTUNE_SERVING_SLOTS": "2",  # the base model's deployment and the full fine-tune's
        "FTUNE_SERVING_MAX_LORA_RANK": "8",
        "FTUNE_SERVING_IDLE_SECONDS": str(IDLE_SECONDS),
        "FTUNE_SERVING_START_WAIT_SECONDS": "300",
        "FTUNE_SERVING_POLL_SECONDS": "0.3",
        "FTUNE_EVAL_HEARTBEAT_SECONDS": "1",
    })
    st.start()
    yield st
    st.stop()


def sdk(stack: FaultStack, api_key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key or stack.api_key,
                         max_retries=0, timeout=600)
