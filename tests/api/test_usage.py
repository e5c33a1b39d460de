"""Usage and cost on the job object and GET /v1/usage; dry runs (POST /v1/jobs?dry_run=true);
the resolved spec and the request as sent."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from core.db.models import Job, JobAttempt, JobEvent
from core.infra.settings import Settings
from core.jobs import usage
from core.spec import parse_job_spec
from tests.utils.api import Api, upload_rows
from tests.utils.tiny import sentences

PRICE = 2.0
ROWS = [{"text": s} for s in sentences(10, seed=5)]


@pytest.fixture(scope="module")
def api_settings(
    tmp_path_factory: pytest.TempPathFactory, db_url: str, tiny_causal_lm: Path
) -> Settings:
    root = tmp_path_factory.mktemp("ftune")
    return Settings(
        data_dir=root / "data",
        DATABASE_URL=db_url,
        BROKER_URL="filesystem://",
        allowed_model_roots=[tiny_causal_lm.parent],
        bootstrap_api_key="ft_bootstrap_" + secrets.token_hex(8),
        jobs_per_minute_per_tenant=1000,
        price_per_gpu_hour=PRICE,
    )


@pytest.fixture(scope="module")
def text_file(api: Api) -> str:
    # The server thread shares this process: import what a dry run needs once, here, so the
    # first dry run is not a cold import of torch/transformers/peft racing the client timeout
    # on a loaded machine.
    import peft  # noqa: F401
    import transformers  # noqa: F401

    return upload_rows(api.client(api.key_a), ROWS)


def body(file_id: str, model: Path, **training: Any) -> dict[str, Any]:
    return {
        "model": {"name_or_path": str(model)},
        "dataset": {"file_id": file_id, "format": "text", "max_seq_length": 128},
        "training": {"num_train_epochs": 2, "per_device_train_batch_size": 4, **training},
    }


def _jobs(api: Api) -> tuple[int, int]:
    with api.session() as s:
        return (s.scalar(select(func.count(Job.id))) or 0,
                s.scalar(select(func.count(JobEvent.id))) or 0)


def _tokens_per_epoch(model: Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    total = 0
    for r in ROWS:
        ids = tok(r["text"])["input_ids"]
        total += len(ids) + (ids[-1] != tok.eos_token_id)
    return total


def test_dry_run_counts_tokens_and_steps_and_records_nothing(
    api: Api, client_a: httpx.Client, text_file: str, tiny_causal_lm: Path
) -> None:
    before = _jobs(api)
    r = client_a.post("/v1/jobs", params={"dry_run": "true"}, json=body(text_file, tiny_causal_lm))
    assert r.status_code == 200, r.text
    est = r.json()
    assert _jobs(api) == before
    assert est["object"] == "estimate"
    assert est["data"]["rows"] == len(ROWS) == est["data"]["examples"]
    assert est["data"]["tokens_per_epoch"] == _tokens_per_epoch(tiny_causal_lm)
    assert est["steps"] == 2 * 3 and est["epochs"] == 2  # ceil(10 / 4) batches per epoch
    assert est["trained_tokens"] == 2 * est["data"]["tokens_per_epoch"]
    assert est["memory"]["total_params"] > est["memory"]["trainable_params"] > 0
    assert est["memory"]["processes"] == 1 and est["memory"]["total_mb"] > 0
    assert est["spec"]["training"]["learning_rate"] == 2e-4  # defaults filled in


def test_dry_run_answers_the_same_422_as_a_submit(
    client_a: httpx.Client, text_file: str, tiny_causal_lm: Path
) -> None:
    bad = body("file-nope", tiny_causal_lm, learning_rate=-1)
    dry = client_a.post("/v1/jobs", params={"dry_run": "true"}, json=bad)
    real = client_a.post("/v1/jobs", json=bad)
    assert dry.status_code == real.status_code == 422
    assert dry.json() == real.json()
    params = {d["param"] for d in dry.json()["error"]["details"]}
    assert {"training.learning_rate", "dataset.file_id"} <= params


def test_dry_run_without_a_local_tokenizer_says_so(
    client_a: httpx.Client, text_file: str
) -> None:
    r = client_a.post("/v1/jobs", params={"dry_run": "true"},
                      json={"model": {"name_or_path": "org/some-model"},
                            "dataset": {"file_id": text_file, "format": "text"}})
    assert r.status_code == 200, r.text
    est = r.json()
    assert est["data"] is None and est["steps"] is None and est["memory"] is None
    assert any("tokenizer" in n for n in est["notes"])


def test_dry_run_tokenizes_only_bounded_data(
    api: Api, client_a: httpx.Client, text_file: str, tiny_causal_lm: Path
) -> None:
    limit = api.settings.dry_run_max_rows
    api.settings.dry_run_max_rows = len(ROWS) - 1
    try:
        r = client_a.post("/v1/jobs", params={"dry_run": "true"},
                          json=body(text_file, tiny_causal_lm))
    finally:
        api.settings.dry_run_max_rows = limit
    est = r.json()
    assert r.status_code == 200 and est["data"] is None and est["steps"] is None
    assert est["memory"] is not None
    assert any("FTUNE_DRY_RUN_MAX_ROWS" in n for n in est["notes"])


def test_job_object_has_the_resolved_spec_and_the_request_as_sent(
    client_a: httpx.Client, text_file: str, tiny_causal_lm: Path
) -> None:
    sent = body(text_file, tiny_causal_lm)
    job = client_a.post("/v1/jobs", json=sent).json()
    assert job["request"] == sent
    assert job["spec"]["training"]["learning_rate"] == 2e-4
    assert job["spec"]["peft"]["method"] == "lora" and job["spec"]["peft"]["r"] == 8
    assert "fsdp" not in job["spec"]["distributed"]  # only what applies to this job
    assert parse_job_spec(job["spec"]).model_dump() == parse_job_spec(sent).model_dump()
    assert job["run"] is None
    assert job["usage"] == {"trained_tokens": 0, "loss_tokens": 0, "wall_seconds": 0.0,
                            "gpu_seconds": 0.0, "attempts": 0, "cost": 0.0,
                            "currency": "USD", "epochs": None}
    again = client_a.get(f"/v1/jobs/{job['id']}").json()
    assert again["spec"] == job["spec"] and again["request"] == sent


DAY = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)


def _ran(api: Api, client: httpx.Client, file_id: str, model: Path,
         attempts: list[tuple[datetime, float, int, int]], info: dict[str, Any] | None = None,
         ) -> str:
    """A job recorded through the API, then given succeeded attempts (start, seconds,
    processes, tokens) as a worker would have."""
    job_id = str(client.post("/v1/jobs", json=body(file_id, model)).json()["id"])
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(
            status="succeeded", attempt=len(attempts), run_info=info, epoch=2.0,
            finished_at=attempts[-1][0] + timedelta(seconds=attempts[-1][1])))
        for n, (start, seconds, processes, tokens) in enumerate(attempts, 1):
            # As the claim opens it, the monitor reports its tokens and the move ends it.
            usage.open_attempt(s, job_id, attempt=n, worker_id="w", started_at=start,
                               processes=processes)
            s.execute(update(JobAttempt).where(JobAttempt.job_id == job_id,
                                               JobAttempt.attempt == n)
                      .values(tokens=tokens, loss_tokens=tokens // 2))
            usage.close_attempt(s, job_id, ended_at=start + timedelta(seconds=seconds))
        s.commit()
    return job_id


@pytest.fixture(scope="module")
def usage_jobs(api: Api, text_file: str, tiny_causal_lm: Path) -> dict[str, str]:
    client_b = api.client(api.key_b)
    file_b = upload_rows(client_b, ROWS)
    a1 = _ran(api, api.client(api.key_a), text_file, tiny_causal_lm,
              [(DAY, 3600, 2, 1000), (DAY + timedelta(hours=2), 1800, 2, 500)])
    a2 = _ran(api, api.client(api.key_a), text_file, tiny_causal_lm,
              [(DAY + timedelta(days=1), 600, 1, 300)])
    b1 = _ran(api, client_b, file_b, tiny_causal_lm, [(DAY, 60, 8, 77)])
    return {"a1": a1, "a2": a2, "b1": b1}


def test_job_object_usage_sums_attempts_and_prices_them(
    client_a: httpx.Client, usage_jobs: dict[str, str]
) -> None:
    job = client_a.get(f"/v1/jobs/{usage_jobs['a1']}").json()
    assert job["usage"] == {
        "trained_tokens": 1500, "loss_tokens": 750, "wall_seconds": 5400.0,
        "gpu_seconds": 2 * 5400.0, "attempts": 2, "cost": 2 * 5400 / 3600 * PRICE,
        "currency": "USD", "epochs": 2.0,
    }


def test_usage_by_day_is_per_tenant(
    client_a: httpx.Client, client_b: httpx.Client, usage_jobs: dict[str, str]
) -> None:
    r = client_a.get("/v1/usage", params={"from": "2026-01-04", "to": "2026-01-06"})
    assert r.status_code == 200, r.text
    rep = r.json()
    days = {d["date"]: d for d in rep["data"]}
    assert list(days) == ["2026-01-04", "2026-01-05", "2026-01-06"]
    assert days["2026-01-04"]["attempts"] == 0
    assert (days["2026-01-05"]["trained_tokens"], days["2026-01-05"]["jobs"]) == (1500, 1)
    assert days["2026-01-05"]["gpu_seconds"] == 2 * 5400
    assert days["2026-01-06"]["trained_tokens"] == 300
    assert rep["total"]["trained_tokens"] == 1800 and rep["total"]["attempts"] == 3
    assert rep["total"]["cost"] == pytest.approx((2 * 5400 + 600) / 3600 * PRICE)
    other = client_b.get("/v1/usage", params={"from": "2026-01-05", "to": "2026-01-05"}).json()
    assert other["total"]["trained_tokens"] == 77 and other["total"]["gpu_seconds"] == 480


@pytest.mark.parametrize(
    ("params", "param"),
    [({"from": "2026-01-06", "to": "2026-01-05"}, "from"),
     ({"from": "2024-01-01", "to": "2026-01-05"}, "to"),
     ({"from": "2026-13-01"}, "from")],
)
def test_usage_dates_are_validated(
    client_a: httpx.Client, params: dict[str, str], param: str
) -> None:
    r = client_a.get("/v1/usage", params=params)
    assert r.status_code == 422
    assert param in str(r.json()["error"]["param"])


def test_usage_needs_a_key(api: Api) -> None:
    assert api.client().get("/v1/usage").status_code == 401


def test_metrics_count_usage_by_tenant(api: Api, usage_jobs: dict[str, str]) -> None:
    with api.session() as s:
        tenant_b = s.scalar(select(Job.tenant_id).where(Job.id == usage_jobs["b1"]))
    text = api.client().get("/metrics").text
    assert f'ftune_trained_tokens_total{{tenant_id="{tenant_b}"}} 77.0' in text
    assert f'ftune_gpu_seconds_total{{tenant_id="{tenant_b}"}} 480.0' in text


@pytest.fixture(scope="module")
def history(api: Api, text_file: str, tiny_causal_lm: Path, usage_jobs: dict[str, str]) -> None:
    """Succeeded jobs of the tiny model's size at 100 and 300 tokens/s (median 200), and
    one of a much larger model, which must not count."""
    from core.model.estimate import estimate
    from core.spec import parse_job_spec

    client = api.client(api.key_a)
    m = estimate(parse_job_spec(body(text_file, tiny_causal_lm)), str(tiny_causal_lm))
    same = {"total_params": m.total_params, "trainable_params": m.trainable_params}
    day = DAY - timedelta(days=30)  # outside the days the usage tests read
    _ran(api, client, text_file, tiny_causal_lm, [(day, 10, 1, 1000)], same)
    _ran(api, client, text_file, tiny_causal_lm, [(day, 10, 1, 3000)], same)
    _ran(api, client, text_file, tiny_causal_lm, [(day, 10, 1, 99_000)],
         {"total_params": 100 * m.total_params, "trainable_params": 1})


def test_dry_run_expects_wall_time_from_jobs_of_the_same_size(
    client_a: httpx.Client, text_file: str, tiny_causal_lm: Path, history: None
) -> None:
    sent = body(text_file, tiny_causal_lm)
    est = client_a.post("/v1/jobs", params={"dry_run": "true"}, json=sent).json()
    assert est["history_jobs"] == 2 and est["tokens_per_second"] == 200
    assert est["wall_seconds"] == pytest.approx(est["trained_tokens"] / 200, abs=0.1)
    assert est["cost"] == pytest.approx(est["gpu_seconds"] / 3600 * PRICE, abs=1e-6)
    assert not any("no history" in n for n in est["notes"])


def test_cli_estimate_asks_the_server_for_a_dry_run(
    api: Api, client_a: httpx.Client, text_file: str, tiny_causal_lm: Path, tmp_path: Path,
    history: None,
) -> None:
    import json

    from typer.testing import CliRunner

    from cli.main import app

    sent = body(text_file, tiny_causal_lm)
    est = client_a.post("/v1/jobs", params={"dry_run": "true"}, json=sent).json()
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(sent))
    result = CliRunner().invoke(
        app, ["estimate", str(f), "--server", "--url", api.url, "--api-key", api.key_a],
        terminal_width=200,
    )
    assert result.exit_code == 0, result.output
    assert f"{est['trained_tokens']:,}" in result.output
    assert f"{est['wall_seconds']:,.0f} s" in result.output


def test_cli_usage_prints_the_days_with_attempts(
    api: Api, usage_jobs: dict[str, str]
) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(
        app, ["usage", "--from", "2026-01-04", "--to", "2026-01-06", "--url", api.url,
              "--api-key", api.key_a], terminal_width=200,
    )
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    days = [line.split("│")[1].strip() for line in rows]
    assert days == ["2026-01-05", "2026-01-06", "total"]  # days without attempts left out
    assert "1,500" in rows[0] and "1,800" in rows[2]
