"""Experiment tracking through the API: trackers checked at submit against the server's
settings, the job object's links (from the trainer's "tracking" event), and the
TensorBoard event files as a zip, tenant-isolated and confined to the job directory."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows
from worker.run.ingest import ingest_events

RUNS = {
    "tensorboard": {"logdir": "tensorboard"},
    "mlflow": {"run_id": "abc123", "experiment_id": "7",
               "url": "http://mlflow.internal/#/experiments/7/runs/abc123"},
    "wandb": {"run_id": "job-x", "project": "ftune", "entity": None, "url": None,
              "mode": "offline"},
}


def submit(client: httpx.Client, **tracking: object) -> httpx.Response:
    file_id = upload_rows(client, TEXT_ROWS)
    return client.post("/v1/jobs", json=job_body(file_id, tracking=tracking))


def test_a_tracker_the_server_does_not_allow_is_a_422_naming_the_field(
    client_a: httpx.Client,
) -> None:
    r = submit(client_a, report_to=["tensorboard", "mlflow"])
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["param"] == "tracking.report_to"
    assert "mlflow not enabled on this server (allowed: tensorboard)" in error["message"]


def test_a_spec_cannot_choose_the_mlflow_server(client_a: httpx.Client) -> None:
    r = submit(client_a, report_to=["mlflow"], mlflow_tracking_uri="http://attacker.example")
    assert r.status_code == 422
    params = {d["param"] for d in r.json()["error"]["details"]}
    assert {"tracking.report_to", "tracking.mlflow_tracking_uri"} <= params


@pytest.fixture
def tracked_job(api: Api, client_a: httpx.Client) -> str:
    r = submit(client_a, report_to=["tensorboard"])
    assert r.status_code == 201, r.text
    assert r.json()["tracking"] is None  # no run yet
    job_id = str(r.json()["id"])
    root = fake_run(api, job_id)
    run_dir = root / "tensorboard"
    run_dir.mkdir()
    (run_dir / "events.out.tfevents.1.host.1.0").write_bytes(b"\x01event")
    (run_dir / "nested").mkdir()
    (run_dir / "nested" / "events.out.tfevents.2.host.1.0").write_bytes(b"\x02event")
    event = {"time": 1_700_000_000.0, "type": "tracking", **RUNS}
    (root / "events.jsonl").write_text(json.dumps(event) + "\n")
    with api.session() as s:
        assert ingest_events(s, job_id, root) == 1
        s.commit()
    return job_id


def test_the_job_object_links_the_runs(client_a: httpx.Client, tracked_job: str) -> None:
    tracking = client_a.get(f"/v1/jobs/{tracked_job}").json()["tracking"]
    assert tracking == {
        "tensorboard": f"/v1/jobs/{tracked_job}/tensorboard",
        "mlflow": RUNS["mlflow"],
        "wandb": RUNS["wandb"],
    }


def test_tensorboard_files_download_as_a_zip(client_a: httpx.Client, tracked_job: str) -> None:
    r = client_a.get(f"/v1/jobs/{tracked_job}/tensorboard")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert zf.namelist() == [
            "tensorboard/events.out.tfevents.1.host.1.0",
            "tensorboard/nested/events.out.tfevents.2.host.1.0",
        ]
        assert zf.read("tensorboard/events.out.tfevents.1.host.1.0") == b"\x01event"


def test_another_tenant_gets_404(client_b: httpx.Client, tracked_job: str) -> None:
    assert client_b.get(f"/v1/jobs/{tracked_job}/tensorboard").status_code == 404


def test_tensorboard_never_serves_outside_the_job_dir(
    api: Api, client_a: httpx.Client, tracked_job: str
) -> None:
    secret = api.roots / "secret.txt"
    secret.write_text("top secret")
    (api.settings.jobs_dir / tracked_job / "tensorboard" / "leak").symlink_to(secret)
    (api.settings.jobs_dir / tracked_job / "tensorboard" / "dirlink").symlink_to(api.roots)
    r = client_a.get(f"/v1/jobs/{tracked_job}/tensorboard")
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert not [n for n in zf.namelist() if "leak" in n or "dirlink" in n]


def test_tensorboard_is_409_without_event_files(api: Api, client_a: httpx.Client) -> None:
    job_id = str(submit(client_a).json()["id"])
    fake_run(api, job_id)
    r = client_a.get(f"/v1/jobs/{job_id}/tensorboard")
    assert r.status_code == 409
    assert "tracking.report_to" in r.json()["error"]["message"]


def test_the_cli_downloads_and_unzips_the_tensorboard_files(
    api: Api, tracked_job: str, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "tb"
    argv = ["download", tracked_job, "--tensorboard", "-o", str(out), "--url", api.url,
            "--api-key", api.key_a]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert (out / "tensorboard" / "events.out.tfevents.1.host.1.0").read_bytes() == b"\x01event"
    assert not (out / f"{tracked_job}.zip").exists()
