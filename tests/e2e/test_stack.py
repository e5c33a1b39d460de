"""The whole path through real processes: uvicorn, a Celery worker, `accelerate launch`.

One stack runs on PostgreSQL + Redis (production shape), one on the embedded default
(SQLite + filesystem broker). Jobs go in over HTTP and adapters come out through the API.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cli.embedded import EmbeddedStack
from client import FtuneAPIError, FtuneClient
from testkit.wait import wait_until
from tests.utils.adapters import assert_adapter_loads
from tests.utils.services import REDIS_URL
from tests.utils.specs import lm_spec
from tests.utils.tiny import (
    classification_rows,
    seq2seq_rows,
    text_rows,
    write_jsonl,
)

pytestmark = pytest.mark.e2e


def processes_using(job_dir: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(job_dir in part for part in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def prod_stack(
    tmp_path_factory: pytest.TempPathFactory, pg_url: str, models_dir: Path
) -> Iterator[EmbeddedStack]:
    """API + a real Celery worker on PostgreSQL and the real Redis broker."""
    stack = EmbeddedStack(
        data_dir=tmp_path_factory.mktemp("prod"),
        api_key="ft_test_" + secrets.token_hex(16),
        env_overrides={
            "DATABASE_URL": pg_url,
            "BROKER_URL": REDIS_URL,
            "FTUNE_QUEUE_NAME": f"ftune.test.{secrets.token_hex(4)}",
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
            "FTUNE_CANCEL_GRACE_SECONDS": "10",
            # The operator lets this CPU worker run FSDP2 (sharded over gloo).
            "FTUNE_CPU_FSDP2": "true",
        },
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def client(prod_stack: EmbeddedStack) -> Iterator[FtuneClient]:
    with FtuneClient(prod_stack.url, prod_stack.api_key) as c:
        yield c


def test_ddp_causal_lm_on_postgres_and_redis(
    client: FtuneClient, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    f = client.upload_file(write_jsonl(tmp_path / "train.jsonl", text_rows(64)))
    spec = lm_spec(tiny_causal_lm, f["id"])
    spec["distributed"] = {"strategy": "ddp", "num_processes": 2}
    job = client.wait(client.create_job(spec)["id"], timeout=300)
    assert job["status"] == "succeeded", job.get("error")
    assert job["progress"]["step"] == 8 and job["progress"]["total_steps"] == 8
    assert job["metrics"]["train_loss"] is not None and job["adapter_available"]
    started = [e for e in client.events(job["id"]) if e["type"] == "started"]
    assert started and started[0]["data"]["world_size"] == 2
    assert [c["step"] for c in client.checkpoints(job["id"])] == [4, 8]
    launch = client.launch(job["id"])
    assert "num_processes: 2" in launch["accelerate_yaml"] and "core.train" in launch["argv"]
    assert_adapter_loads(client, job["id"], tiny_causal_lm, tmp_path, AutoModelForCausalLM)


def test_fsdp2_job_through_the_service(
    client: FtuneClient, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    """FSDP2 on two CPU ranks, as a user submits it: sharded for real, the adapter of the
    final save and of a sharded checkpoint both download and load."""
    from transformers import AutoModelForCausalLM

    f = client.upload_file(write_jsonl(tmp_path / "train.jsonl", text_rows(64)))
    spec = lm_spec(tiny_causal_lm, f["id"])
    spec["distributed"] = {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2}}
    job = client.wait(client.create_job(spec)["id"], timeout=300)
    assert job["status"] == "succeeded", job.get("error")
    (started,) = [e["data"] for e in client.events(job["id"]) if e["type"] == "started"]
    assert (started["distributed_type"], started["world_size"]) == ("FSDP", 2)
    assert started["fsdp_sharded_params"] > 0 and started["fsdp_largest_param_local_fraction"] < 1
    launch = client.launch(job["id"])
    assert "distributed_type: FSDP" in launch["accelerate_yaml"]
    assert launch["env"]["ACCELERATE_USE_CPU"] == "true"
    assert [c["step"] for c in client.checkpoints(job["id"])] == [4, 8]
    assert_adapter_loads(client, job["id"], tiny_causal_lm, tmp_path, AutoModelForCausalLM)
    assert_adapter_loads(
        client, job["id"], tiny_causal_lm, tmp_path / "ckpt", AutoModelForCausalLM, checkpoint=4
    )


def test_seq2seq_job(client: FtuneClient, tiny_seq2seq_lm: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSeq2SeqLM

    f = client.upload_file(write_jsonl(tmp_path / "s2s.jsonl", seq2seq_rows(32)))
    spec = lm_spec(tiny_seq2seq_lm, f["id"])
    spec["model"]["task"] = "seq2seq_lm"
    spec["dataset"]["format"] = "seq2seq"
    job = client.wait(client.create_job(spec)["id"], timeout=300)
    assert job["status"] == "succeeded", job.get("error")
    assert_adapter_loads(client, job["id"], tiny_seq2seq_lm, tmp_path, AutoModelForSeq2SeqLM)


def test_seq_cls_job(client: FtuneClient, tiny_seq_cls: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    f = client.upload_file(write_jsonl(tmp_path / "cls.jsonl", classification_rows(32)))
    spec = lm_spec(tiny_seq_cls, f["id"])
    spec["model"]["task"] = "seq_cls"
    spec["dataset"]["format"] = "classification"
    spec["peft"]["target_modules"] = ["query", "value"]
    job = client.wait(client.create_job(spec)["id"], timeout=300)
    assert job["status"] == "succeeded", job.get("error")
    assert_adapter_loads(
        client, job["id"], tiny_seq_cls, tmp_path, AutoModelForSequenceClassification
    )


@pytest.mark.parametrize(
    "distributed",
    [
        {"strategy": "ddp", "num_processes": 2},
        {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2}},
    ],
    ids=["ddp", "fsdp2"],
)
def test_cancel_mid_training_leaves_no_process(
    client: FtuneClient, tiny_causal_lm: Path, tmp_path: Path, distributed: dict
) -> None:
    f = client.upload_file(write_jsonl(tmp_path / "train.jsonl", text_rows(64)))
    spec = lm_spec(tiny_causal_lm, f["id"], max_steps=100_000, save_steps=100_000)
    spec["distributed"] = distributed
    job_id = client.create_job(spec)["id"]

    def at_step_2() -> bool:
        job = client.get_job(job_id)
        assert job["status"] in ("queued", "running")
        return job["progress"]["step"] >= 2

    wait_until(at_step_2, 180, "training to reach step 2", every=0.5)
    job_dir = client.launch(job_id)["argv"][-1]
    assert processes_using(job_dir), "expected live trainer processes before the cancel"
    assert client.cancel_job(job_id)["status"] in ("cancelling", "cancelled")
    job = client.wait(job_id, timeout=120)
    assert job["status"] == "cancelled"
    assert processes_using(job_dir) == []
    assert not job["adapter_available"]


def test_dataset_missing_field_is_refused_at_submit(
    client: FtuneClient, tiny_causal_lm: Path, tmp_path: Path
) -> None:
    f = client.upload_file(write_jsonl(tmp_path / "bad.jsonl", [{"body": "x"}] * 4))
    with pytest.raises(FtuneAPIError) as e:
        client.create_job(lm_spec(tiny_causal_lm, f["id"]))
    assert e.value.status == 422
    assert any(d["param"] == "dataset.text_field" for d in e.value.details)
    assert "no row has a column 'text'; the rows have body" in str(e.value)


def test_trainer_crash_ends_failed_with_the_error(
    client: FtuneClient, tiny_causal_lm: Path, models_dir: Path, tmp_path: Path
) -> None:
    import shutil

    broken = models_dir / "broken-llama"
    if not broken.exists():
        shutil.copytree(tiny_causal_lm, broken)
        (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    f = client.upload_file(write_jsonl(tmp_path / "train.jsonl", text_rows(16)))
    job = client.wait(client.create_job(lm_spec(broken, f["id"]))["id"], timeout=180)
    assert job["status"] == "failed"
    assert job["error"]["code"] in ("model_not_found", "trainer_crashed")
    assert job["error"]["message"]
    assert client.logs(job["id"], tail=50), "the trainer log should be readable"


def test_embedded_default_trains_and_serves_the_adapter(
    tmp_path: Path, tiny_causal_lm: Path, models_dir: Path
) -> None:
    """SQLite + filesystem broker: no Redis, no Postgres."""
    from transformers import AutoModelForCausalLM

    stack = EmbeddedStack(
        data_dir=tmp_path / "embedded",
        env_overrides={
            "DATABASE_URL": f"sqlite:///{tmp_path / 'embedded' / 'ftune.db'}",
            "BROKER_URL": "filesystem://",
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
        },
    )
    with stack, FtuneClient(stack.url, stack.api_key) as c:
        f = c.upload_file(write_jsonl(tmp_path / "train.jsonl", text_rows(64)))
        spec = lm_spec(tiny_causal_lm, f["id"])
        spec["distributed"] = {"strategy": "ddp", "num_processes": 2}
        job = c.wait(c.create_job(spec)["id"], timeout=300)
        assert job["status"] == "succeeded", job.get("error")
        assert_adapter_loads(c, job["id"], tiny_causal_lm, tmp_path, AutoModelForCausalLM)
