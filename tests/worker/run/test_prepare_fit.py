"""worker.prepare.check_fit: at claim, a full fine-tune must fit the GPUs this run holds
(hub models reach this point unchecked: the API reads no remote config)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from core.infra.settings import Settings
from core.policy import Refused
from core.run.plan import Runtime
from core.spec import parse_job_spec
from worker.run.claim import Claim
from worker.run.prepare import check_fit


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("models") / "llama-2-70b"
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8,
                vocab_size=32000).save_pretrained(folder)
    return folder


def claim(spec: dict[str, Any], gpus: int) -> Claim:
    return Claim("job-1", "tenant", "w", 1, parse_job_spec(spec), datetime.now(UTC),
                 gpu_ids=tuple(range(gpus)))


def settings(memory_mb: int) -> Settings:
    return Settings(fake_gpus=[{"name": "A100", "memory_mb": memory_mb}] * 8)


def test_a_full_fine_tune_too_big_for_the_held_gpus_is_refused(llama_70b: Path) -> None:
    body = {"model": {"name_or_path": "meta-llama/Llama-2-70b-hf"},
            "dataset": {"file_id": "f"}, "peft": {"method": "full"},
            "training": {"mixed_precision": "bf16"},
            "distributed": {"strategy": "fsdp", "num_processes": 8}}
    runtime = Runtime(job_id="job-1", model_path=str(llama_70b), train_path=Path("/d"))
    with pytest.raises(Refused) as e:
        check_fit(parse_job_spec(body), runtime, claim(body, 8), settings(81_920))
    assert e.value.param == "distributed.num_processes"
    # The same job on GPUs whose memory the worker does not know is not refused here.
    check_fit(parse_job_spec(body), runtime, claim(body, 8), settings(0))
