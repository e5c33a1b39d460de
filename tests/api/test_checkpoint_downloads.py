"""Every checkpoint downloads, under every strategy: through the API, the checkpoints of
real 2-process runs whose training state the API cannot serve as it is (a DeepSpeed ZeRO-3
engine checkpoint of a full fine-tune, FSDP1's sharded flat parameters under an adapter)
answer 200 with files that load: the model at that step, the adapter at that step."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, upload_rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS, SAVED = 3, 2


def trained(root: Path, model: Path, peft: dict[str, object],
            distributed: dict[str, object]) -> Path:
    from tests.utils.jobdirs import launch, make_job
    from tests.utils.tiny import text_rows

    job = make_job(root, model, text_rows(24),
                   spec={"peft": peft, "distributed": distributed,
                         "training": {"max_steps": STEPS, "save_steps": SAVED,
                                      "logging_steps": 1}},
                   runtime={"cpu_fsdp2": True})
    launch(job)
    return job


@pytest.fixture(scope="module")
def zero3_full(
    shm_comm: float, tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return trained(tmp_path_factory.mktemp("zero3-full"), tiny_causal_lm, {"method": "full"},
                   {"strategy": "deepspeed", "num_processes": 2,
                    "deepspeed": {"zero_stage": 3}})


@pytest.fixture(scope="module")
def fsdp1_lora(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained(tmp_path_factory.mktemp("fsdp1-lora"), tiny_causal_lm,
                   {"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
                   {"strategy": "fsdp", "num_processes": 2,
                    "fsdp": {"version": 1, "sync_module_states": False,
                             "cpu_ram_efficient_loading": False}})


def running_job_with(api: Api, client: httpx.Client, trained_job: Path, peft: str) -> str:
    """A running job of this API whose job directory holds ``trained_job``'s checkpoints."""
    from core.db.models import Checkpoint

    file_id = upload_rows(client, TEXT_ROWS)
    body = {"model": {"name_or_path": "org/tiny-model"},
            "dataset": {"file_id": file_id, "format": "text"}, "peft": {"method": peft}}
    job_id = str(client.post("/v1/jobs", json=body).json()["id"])
    root = fake_run(api, job_id, status="running")
    shutil.copytree(trained_job / "checkpoints", root / "checkpoints")
    with api.session() as s:
        s.add(Checkpoint(job_id=job_id, step=SAVED, metrics={},
                         path=str((root / "checkpoints" / f"checkpoint-{SAVED}").resolve())))
        s.commit()
    return job_id


def test_a_zero3_full_checkpoint_downloads_as_the_model_at_that_step(
    api: Api, client_a: httpx.Client, zero3_full: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from client import FtuneClient
    from tests.utils.jobdirs import model_weights

    job_id = running_job_with(api, client_a, zero3_full, "full")
    listing = client_a.get(f"/v1/jobs/{job_id}/model", params={"checkpoint": SAVED})
    assert listing.status_code == 200, listing.text
    dest = tmp_path / "ckpt"
    with FtuneClient(api.url, api.key_a) as c:
        c.download_model(job_id, dest, checkpoint=SAVED)
    model = AutoModelForCausalLM.from_pretrained(dest)
    # The weights after step 2, not the final ones nor the base.
    final = model_weights(zero3_full / "model")
    base = AutoModelForCausalLM.from_pretrained(api_model(zero3_full))
    name = "model.layers.0.mlp.down_proj.weight"
    got = model.get_parameter(name)
    assert not torch.equal(got, final[name]) and not torch.equal(got, base.get_parameter(name))


def api_model(job: Path) -> str:
    import json

    return str(json.loads((job / "spec.json").read_text())["runtime"]["model_path"])


def test_an_fsdp1_adapter_checkpoint_downloads_and_loads(
    api: Api, client_a: httpx.Client, fsdp1_lora: Path, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    job_id = running_job_with(api, client_a, fsdp1_lora, "lora")
    r = client_a.get(f"/v1/jobs/{job_id}/adapter", params={"checkpoint": SAVED})
    assert r.status_code == 200, r.text
    folder = tmp_path / "adapter"
    zipfile.ZipFile(io.BytesIO(r.content)).extractall(folder)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    # Plain peft names (no FSDP wrapper, no adapter name), every lora_B trained away from 0.
    assert saved and all("_fsdp_wrapped_module" not in k and ".default." not in k
                         for k in saved)
    assert all(bool(v.any()) for k, v in saved.items() if "lora_B" in k)
    base = AutoModelForCausalLM.from_pretrained(api_model(fsdp1_lora))
    model = PeftModel.from_pretrained(base, str(folder))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    # Not the final adapter: the one of step 2.
    final = load_file(str(fsdp1_lora / "adapter" / "adapter_model.safetensors"))
    assert set(final) == set(saved)
    assert any(not torch.equal(final[k], saved[k]) for k in saved)
