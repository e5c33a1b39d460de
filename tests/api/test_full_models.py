"""Full fine-tuning through the API: admission knows what a 70B full fine-tune needs per GPU
(Llama 2 70B's config only, on the meta device: no weights anywhere), and a fully trained
model is listed and downloaded file by file, with HTTP Range, by its tenant only; the
client resumes a partial download and the result loads and generates."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, update

from core.db.models import Job, JobStatus, Worker
from core.infra.settings import Settings
from core.train.full_model import write_manifest
from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, upload_rows
from worker.upkeep.registry import Inventory, register

A100_80GB = 81_920


@pytest.fixture(scope="module")
def api_settings(
    tmp_path_factory: pytest.TempPathFactory, db_url: str, tiny_causal_lm: Path
) -> Settings:
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("ftune")
    models = root / "models"
    shutil.copytree(tiny_causal_lm, models / "tiny")
    # meta-llama/Llama-2-70b-hf's config.json, and nothing else.
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                max_position_embeddings=4096, dtype="float16").save_pretrained(models / "llama-2-70b")
    return Settings(
        data_dir=root / "data", DATABASE_URL=db_url, BROKER_URL="filesystem://",
        allowed_model_roots=[models], bootstrap_api_key="ft_bootstrap_" + secrets.token_hex(8),
        jobs_per_minute_per_tenant=1000,
    )


@pytest.fixture
def a100_pool(api: Api) -> Iterator[None]:
    """One registered pool: nodes of 8 A100 80GB, jobs on up to 2 of them."""
    inv = Inventory("pool", [{"index": i, "name": "A100", "memory_mb": A100_80GB}
                             for i in range(8)], 64,
                    {"cuda": True, "bf16": True, "max_machines": 2}, 1, executor="slurm")
    with api.maker.begin() as s:
        register(s, "a100-pool", inv)
    yield
    with api.maker.begin() as s:
        s.execute(update(Job).where(Job.status == JobStatus.queued)
                  .values(status=JobStatus.cancelled))
        s.execute(delete(Worker))


def llama_70b(api: Api, file_id: str, **distributed: Any) -> dict[str, Any]:
    return {
        "model": {"name_or_path": str(api.settings.allowed_model_roots[0] / "llama-2-70b")},
        "dataset": {"file_id": file_id, "format": "text", "max_seq_length": 2048},
        "peft": {"method": "full"},
        "training": {"per_device_train_batch_size": 1, "mixed_precision": "bf16",
                     "max_steps": 10},
        "distributed": distributed,
    }


SEEDS = {"strategy": "fsdp", "num_processes": 16, "num_machines": 2,
         "fsdp": {"sharding_strategy": "FULL_SHARD", "activation_checkpointing": True}}


def test_70b_full_fine_tune_is_admitted_on_2_nodes_of_8_with_its_estimate(
    api: Api, a100_pool: None, client_a: httpx.Client
) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    dry = client_a.post("/v1/jobs", params={"dry_run": "true"}, json=llama_70b(api, file_id, **SEEDS))
    assert dry.status_code == 200, dry.text
    memory = dry.json()["memory"]
    assert memory["trainable_params"] == memory["total_params"] == 68_976_648_192
    assert memory["processes"] == 16
    # bf16 weights + gradients, fp32 master weights + Adam moments: 16 B/param over 16 ranks
    # (65,781 MiB), and two decoder layers gathered whole in bf16 (3,289 MiB).
    assert memory["weights_mb"] + memory["training_state_mb"] == pytest.approx(69_070, abs=1)
    assert memory["total_mb"] < A100_80GB
    r = client_a.post("/v1/jobs", json=llama_70b(api, file_id, **SEEDS))
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(("distributed", "param", "says"), [
    ({"strategy": "ddp", "num_processes": 16, "num_machines": 2}, "distributed.strategy",
     ("ddp: DDP keeps a whole copy on every process: full fine-tuning holds 1,052,500 MiB per "
     "process")),
    ({"strategy": "fsdp", "num_processes": 8}, "distributed.num_processes",
     "8 processes: full fine-tuning holds 134,852 MiB per process"),
])
def test_70b_full_fine_tune_that_cannot_fit_is_refused_naming_the_field(
    api: Api, a100_pool: None, client_a: httpx.Client, distributed: dict[str, Any],
    param: str, says: str
) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    r = client_a.post("/v1/jobs", json=llama_70b(api, file_id, **distributed))
    assert r.status_code == 422, r.text
    (problem,) = [d for d in r.json()["error"]["details"] if d["param"] == param]
    assert problem["message"].startswith(says)
    assert "but a GPU has 81,920 MiB" in problem["message"]


def test_full_with_quantization_is_a_422_naming_the_method(
    api: Api, client_a: httpx.Client
) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    body = llama_70b(api, file_id, strategy="none")
    body["model"]["quantization"] = {"load_in": "4bit"}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "peft.method"


@pytest.fixture
def full_job(api: Api, client_a: httpx.Client) -> tuple[str, Path]:
    """A succeeded full fine-tune: the tiny Llama as the trainer publishes a model/."""
    file_id = upload_rows(client_a, TEXT_ROWS)
    body = {"model": {"name_or_path": "org/tiny-model"},
            "dataset": {"file_id": file_id, "format": "text"}, "peft": {"method": "full"}}
    job_id = str(client_a.post("/v1/jobs", json=body).json()["id"])
    root = fake_run(api, job_id, status="succeeded")
    folder = root / "model"
    shutil.copytree(api.settings.allowed_model_roots[0] / "tiny", folder)
    write_manifest(folder)
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(adapter_path=str(folder.resolve())))
        s.commit()
    return job_id, folder


def test_model_listing_and_ranges(
    full_job: tuple[str, Path], client_a: httpx.Client, client_b: httpx.Client
) -> None:
    job_id, folder = full_job
    job = client_a.get(f"/v1/jobs/{job_id}").json()
    assert (job["model_available"], job["adapter_available"]) == (True, False)
    listing = client_a.get(f"/v1/jobs/{job_id}/model").json()
    names = {f["name"] for f in listing["data"]}
    # The listing is files.json as the trainer wrote it; it does not list itself.
    assert names == {p.name for p in folder.iterdir()} - {"files.json"}
    assert listing["total_bytes"] == sum(f["bytes"] for f in listing["data"])
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    url = f"/v1/jobs/{job_id}/model/model.safetensors"
    whole = client_a.get(url)
    assert (whole.status_code, whole.content) == (200, data)
    part = client_a.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == data[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{len(data)}"
    beyond = client_a.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert beyond.status_code == 416
    assert client_a.get(f"/v1/jobs/{job_id}/model/..%2Fspec.json").status_code == 404
    assert client_a.get(f"/v1/jobs/{job_id}/model/nope.bin").status_code == 404
    assert client_b.get(url).status_code == 404  # another tenant's job does not exist for it
    assert client_b.get(f"/v1/jobs/{job_id}/model").status_code == 404
    adapter = client_a.get(f"/v1/jobs/{job_id}/adapter")
    assert adapter.status_code == 409 and f"/v1/jobs/{job_id}/model" in adapter.text


def test_download_resumes_a_partial_file_and_the_model_generates(
    api: Api, full_job: tuple[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from client import FtuneClient

    job_id, folder = full_job
    dest = tmp_path / "model"
    dest.mkdir()
    data = (folder / "model.safetensors").read_bytes()
    (dest / "model.safetensors.part").write_bytes(data[: len(data) // 2])  # interrupted
    statuses: dict[str, int] = {}

    def seen(resp: httpx.Response) -> None:
        statuses[resp.request.url.path.rsplit("/", 1)[-1]] = resp.status_code

    counted: list[int] = []
    with FtuneClient(api.url, api.key_a) as c:
        c._http.event_hooks["response"].append(seen)
        c.download_model(job_id, dest, on_bytes=counted.append)
    assert statuses["model.safetensors"] == 206  # only the missing half was sent
    assert sum(counted) == sum(p.stat().st_size for p in folder.iterdir()
                               if p.name != "files.json")
    assert not list(dest.glob("*.part"))
    model = AutoModelForCausalLM.from_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(dest)
    out = model.generate(**tok(["the quick"], return_tensors="pt"), max_new_tokens=3,
                         do_sample=False)
    assert out.shape[1] > 2


def test_cli_download_writes_the_model_directory(
    api: Api, full_job: tuple[str, Path], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    job_id, folder = full_job
    result = CliRunner().invoke(app, ["download", job_id, "-o", str(tmp_path / "m"),
                                      "--url", api.url, "--api-key", api.key_a])
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "m").iterdir()} == {
        p.name for p in folder.iterdir()} - {"files.json"}


@pytest.fixture(scope="module")
def trained_full(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real full fine-tune on one process (the trainer, no worker), checkpoint at step 2."""
    from tests.utils.jobdirs import launch, make_job
    from tests.utils.tiny import text_rows

    job = make_job(tmp_path_factory.mktemp("trained-full"), tiny_causal_lm, text_rows(16),
                   spec={"peft": {"method": "full"},
                         "training": {"max_steps": 3, "save_steps": 2, "logging_steps": 1}})
    launch(job)
    return job


def test_a_checkpoint_of_a_full_job_downloads_as_the_model_at_that_step(
    api: Api, client_a: httpx.Client, client_b: httpx.Client, trained_full: Path,
    tmp_path: Path
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from client import FtuneClient
    from core.db.models import Checkpoint

    file_id = upload_rows(client_a, TEXT_ROWS)
    body = {"model": {"name_or_path": "org/tiny-model"},
            "dataset": {"file_id": file_id, "format": "text"}, "peft": {"method": "full"}}
    job_id = str(client_a.post("/v1/jobs", json=body).json()["id"])
    root = fake_run(api, job_id, status="running")  # checkpoints download while it runs
    shutil.copytree(trained_full / "checkpoints", root / "checkpoints")
    with api.session() as s:
        s.add(Checkpoint(job_id=job_id, step=2,
                         path=str((root / "checkpoints" / "checkpoint-2").resolve()), metrics={}))
        s.commit()

    listing = client_a.get(f"/v1/jobs/{job_id}/model", params={"checkpoint": 2}).json()
    assert listing["checkpoint"] == 2
    assert all(f["url"].endswith("?checkpoint=2") for f in listing["data"])
    assert client_b.get(f"/v1/jobs/{job_id}/model", params={"checkpoint": 2}).status_code == 404
    missing = client_a.get(f"/v1/jobs/{job_id}/model", params={"checkpoint": 3})
    assert (missing.status_code, missing.json()["error"]["param"]) == (404, "checkpoint")
    adapter = client_a.get(f"/v1/jobs/{job_id}/adapter", params={"checkpoint": 2})
    assert adapter.status_code == 409 and "/model?checkpoint=2" in adapter.text
    assert client_a.get(f"/v1/jobs/{job_id}/model").status_code == 409  # no final model yet

    dest = tmp_path / "ckpt"
    with FtuneClient(api.url, api.key_a) as c:
        c.download_model(job_id, dest, checkpoint=2)
    model = AutoModelForCausalLM.from_pretrained(dest)
    # The weights at step 2: the DCP state the trainer resumes from, read here whole.
    reader = dcp.FileSystemReader(str(trained_full / "checkpoints" / "checkpoint-2" / "state"))
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith("model.")}
    dcp.load(state, storage_reader=reader)
    params = dict(model.named_parameters())
    assert len(state) == len(params)
    for key, want in state.items():
        assert torch.equal(params[key.removeprefix("model.")], want), key


def test_cli_download_of_a_full_checkpoint(
    api: Api, client_a: httpx.Client, trained_full: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from cli.main import app
    from core.db.models import Checkpoint

    file_id = upload_rows(client_a, TEXT_ROWS)
    body = {"model": {"name_or_path": "org/tiny-model"},
            "dataset": {"file_id": file_id, "format": "text"}, "peft": {"method": "full"}}
    job_id = str(client_a.post("/v1/jobs", json=body).json()["id"])
    root = fake_run(api, job_id, status="running")
    shutil.copytree(trained_full / "checkpoints", root / "checkpoints")
    with api.session() as s:
        s.add(Checkpoint(job_id=job_id, step=2,
                         path=str((root / "checkpoints" / "checkpoint-2").resolve()), metrics={}))
        s.commit()
    result = CliRunner().invoke(app, ["download", job_id, "--checkpoint", "2", "-o",
                                      str(tmp_path / "m"), "--url", api.url,
                                      "--api-key", api.key_a])
    assert result.exit_code == 0, result.output
    ckpt_model = trained_full / "checkpoints" / "checkpoint-2" / "model"
    assert {p.name for p in (tmp_path / "m").iterdir()} == {
        p.name for p in ckpt_model.iterdir()} - {"files.json"}
