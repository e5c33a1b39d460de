"""The dashboard under /ui: static files with a CSP, and the page driven in headless Chromium
against the live service (Debian's /usr/bin/chromium through playwright; `make test`
installs it when it can, and the browser tests skip when it is missing). The edges a new
user meets in the first hour are tests/api/test_dashboard_edges.py."""

from __future__ import annotations

import json
import re
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import update

from api.routes.ui import CONTENT_SECURITY_POLICY, STATIC_DIR
from core.db.models import Job, JobEvent, utcnow
from tests.api.jobfixtures import ADAPTER_FILES, fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows
from tests.utils.browser import use_key
from tests.utils.png import assert_real_screenshot, png_rgb

# A name and an event that would run script if the page put server strings in unescaped.
EVIL_NAME = '<img src=x onerror="window.__xss=1">dash</b>'
EVIL_MESSAGE = "<script>window.__xss=2</script>boom"
LOSSES = [2.0, 1.7, 1.5, 1.3, 1.2, 1.1, 1.0, 0.95, 0.9, 0.85]
EVALS = {5: 1.4, 10: 1.05}
STEP = 10


# --------------------------------------------------------------------------- without a browser


def test_root_redirects_to_the_dashboard(api: Api) -> None:
    r = httpx.get(api.url + "/", follow_redirects=False)
    assert r.status_code == 302 and r.headers["location"] == "/ui"


def test_dashboard_page_needs_no_key_and_has_a_csp(api: Api) -> None:
    r = httpx.get(api.url + "/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert r.headers["x-content-type-options"] == "nosniff"
    assert '<script src="/ui/static/app.js"></script>' in r.text
    js = httpx.get(api.url + "/ui/static/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert js.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert httpx.get(api.url + "/ui/static/app.css").headers["content-type"].startswith("text/css")
    assert "content-security-policy" not in httpx.get(api.url + "/healthz").headers
    metrics = httpx.get(api.url + "/metrics").text
    assert 'route="/ui/static/{path}",status="200"' in metrics


@pytest.mark.parametrize(
    "path",
    [
        "/ui/static/",
        "/ui/static",
        "/ui/static/missing.js",
        "/ui/static/%2e%2e/routes/ui.py",
        "/ui/static/..%2f..%2fmain.py",
        "/ui/static/%2e%2e%2f%2e%2e%2fcore%2fsettings.py",
    ],
)
def test_static_files_list_no_folder_and_serve_nothing_outside(api: Api, path: str) -> None:
    with httpx.Client(base_url=api.url, follow_redirects=True) as c:
        r = c.send(c.build_request("GET", httpx.URL(api.url + path)))
    assert r.status_code == 404, (path, r.status_code, r.text[:200])
    assert "import" not in r.text and "<li>" not in r.text


def test_page_and_script_obey_the_csp_statically() -> None:
    """No inline script or style the CSP would block: the browser test would only show a
    blank or broken page, this says where."""
    html = (STATIC_DIR / "index.html").read_text()
    js = (STATIC_DIR / "app.js").read_text()
    for m in re.finditer(r"<script\b([^>]*)>(.*?)</script>", html, re.DOTALL):
        assert "src=" in m.group(1) and not m.group(2).strip(), m.group(0)
    assert "<style" not in html
    for text in (html, js):
        assert not re.search(r"\sstyle=", text)
        assert not re.search(r"<[^>]+\son[a-z]+=", text)  # inline event handlers
        assert "javascript:" not in text
    assert "eval(" not in js and "new Function" not in js


# --------------------------------------------------------------------------- in Chromium


@pytest.fixture(scope="module")
def finished_job(api: Api) -> str:
    """A succeeded job as the worker leaves it: events with loss and eval, log, adapter."""
    client = api.client(api.key_a)
    file_id = upload_rows(client, TEXT_ROWS)
    job_id = str(client.post("/v1/jobs", json=job_body(file_id, name=EVIL_NAME)).json()["id"])
    fake_run(api, job_id, status="succeeded", log_lines=25, checkpoints=(5, 10), adapter=True)
    now = utcnow()
    with api.session() as s:
        for step, loss in enumerate(LOSSES, start=1):
            data = {"step": step, "total_steps": STEP, "loss": loss, "learning_rate": 2e-4 / step}
            data["tokens_per_second"] = 900.0 + step
            s.add(JobEvent(job_id=job_id, type="progress", message=f"step {step}", data=data))
        for step, loss in EVALS.items():
            s.add(
                JobEvent(
                    job_id=job_id, type="eval", message="", data={"step": step, "eval_loss": loss}
                )
            )
        s.add(JobEvent(job_id=job_id, type="log", message=EVIL_MESSAGE, data={}))
        s.add(JobEvent(job_id=job_id, type="finished", message="finished", data={"step": STEP}))
        launch = {"argv": ["accelerate", "launch", "-m", "core.train"], "accelerate_yaml": "x: 1\n"}
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(step=STEP, total_steps=STEP, train_loss=LOSSES[-1], eval_loss=EVALS[10],
                    tokens_per_second=910.0, finished_at=now, launch=launch)
        )  # fmt: skip
        s.commit()
    return job_id


def test_dashboard_shows_the_job_its_charts_logs_and_adapter(
    api: Api, page: Any, finished_job: str, tmp_path: Path
) -> None:
    page.goto(api.url + "/")
    assert page.url == api.url + "/ui"
    page.wait_for_selector("text=Enter an API key above to begin.")
    use_key(page, api.key_a)

    link = f"a[href='#/jobs/{finished_job}']"
    page.wait_for_selector(f"#jobs {link}")
    row = page.inner_text(f"#jobs tr:has({link})")
    assert "succeeded" in row and "10/10" in row and EVIL_NAME in row
    assert page.evaluate("localStorage.getItem('ftune.apiKey')") == api.key_a
    page.click(f"#jobs {link}")

    page.wait_for_selector("svg.chart[aria-label='Loss'] polyline")
    lines = page.eval_on_selector_all(
        "svg.chart[aria-label='Loss'] polyline", "els => els.map(e => e.getAttribute('points'))"
    )
    assert [len(p.split()) for p in lines] == [len(LOSSES), len(EVALS)]
    for points in lines:
        assert all(re.fullmatch(r"\d+(\.\d)?,\d+(\.\d)?", xy) for xy in points.split())
    lr = page.eval_on_selector_all(
        "svg.chart[aria-label='Learning rate'] polyline", "e => e.length"
    )
    assert lr == 1
    events = page.inner_text("#events")
    assert "step 10" in events and EVIL_MESSAGE in events
    assert page.inner_text("#logs").splitlines() == [f"line {i}" for i in range(1, 26)]
    assert page.inner_text("h2").startswith(EVIL_NAME)
    assert page.evaluate("window.__xss") is None
    assert page.query_selector("#view img") is None and page.query_selector("#view script") is None
    assert page.is_visible("#download") and page.query_selector("#cancel") is None

    shot = tmp_path / "job.png"
    page.screenshot(path=str(shot), full_page=True)
    assert_real_screenshot(shot.read_bytes())

    with page.expect_download() as download:
        page.click("#download")
    assert download.value.suggested_filename == f"{finished_job}-adapter.zip"
    saved = tmp_path / "adapter.zip"
    download.value.save_as(saved)
    with zipfile.ZipFile(saved) as zf:
        assert {n: zf.read(n) for n in zf.namelist()} == ADAPTER_FILES
    assert page.problems == []


def test_submit_form_shows_every_problem_then_queues_the_job(api: Api, page: Any) -> None:
    client = api.client(api.key_a)
    file_id = upload_rows(client, TEXT_ROWS)
    page.goto(api.url + "/ui#/new")
    use_key(page, api.key_a)
    page.wait_for_selector("#spec")

    bad = job_body("file-doesnotexist", training={"learning_rate": -1})
    page.fill("#spec", json.dumps(bad))
    page.click("#submit")
    page.wait_for_selector("#submiterr:has-text('422')")
    error = page.inner_text("#submiterr")
    assert "invalid_spec" in error
    assert "dataset.file_id" in error and "training.learning_rate" in error

    page.fill("#spec", "{not json")
    page.click("#submit")
    page.wait_for_selector("#submiterr:has-text('Not JSON')")

    before = len(api.enqueue.calls)
    page.fill("#spec", json.dumps(job_body(file_id, name="from the form")))
    page.click("#submit")
    page.wait_for_url(re.compile(r".*#/jobs/job-[0-9a-f]+$"))
    job_id = page.url.rsplit("/", 1)[-1]
    page.wait_for_selector("h2:has-text('from the form')")
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["name"] == "from the form" and job["status"] == "queued"
    assert api.enqueue.calls[before:] == [(job_id, "queued")]
    assert page.problems == []


def test_pause_and_resume_buttons(api: Api, page: Any) -> None:
    client = api.client(api.key_a)
    job_id = client.post("/v1/jobs", json=job_body(upload_rows(client, TEXT_ROWS))).json()["id"]
    page.goto(api.url + f"/ui#/jobs/{job_id}")
    use_key(page, api.key_a)
    page.wait_for_selector("#pause")
    assert page.query_selector("#resume") is None

    page.click("#pause")
    page.wait_for_selector("#resume")
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "paused"
    assert page.query_selector("#pause") is None and page.is_visible("#cancel")

    before = len(api.enqueue.calls)
    page.click("#resume")
    page.wait_for_selector("#pause")
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    assert api.enqueue.calls[before:] == [(job_id, "queued")]
    assert page.problems == []


def test_a_wrong_key_shows_the_error(api: Api, page: Any) -> None:
    page.goto(api.url + "/ui")
    use_key(page, "ft_not-a-key-" + "x" * 20)
    page.wait_for_selector("#view .error")
    assert "401" in page.inner_text("#view .error")
    assert page.problems == []


# --------------------------------------------------------------------------- PNG check


def test_png_decoder_undoes_every_filter() -> None:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    def predict(kind: int, row: list[int], prev: list[int], i: int, bpp: int) -> int:
        a = row[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        paeth = a if pa <= pb and pa <= pc else b if pb <= pc else c
        return [0, a, b, (a + b) // 2, paeth][kind]

    width, height, bpp = 7, 10, 4
    image = np.random.default_rng(0).integers(0, 256, (height, width * bpp), dtype=np.uint8)
    raw, prev = b"", [0] * (width * bpp)
    for y, row in enumerate(image.tolist()):
        kind = y % 5  # every filter type, twice
        raw += bytes(
            [kind] + [(v - predict(kind, row, prev, i, bpp)) & 0xFF for i, v in enumerate(row)]
        )
        prev = row
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    expected = image.reshape(height, width, bpp)[:, :, :3]
    assert np.array_equal(png_rgb(png), expected)


def test_dashboard_links_the_tracking_runs_and_downloads_tensorboard(
    api: Api, page: Any, tmp_path: Path
) -> None:
    client = api.client(api.key_a)
    file_id = upload_rows(client, TEXT_ROWS)
    body = job_body(file_id, tracking={"report_to": ["tensorboard"]})
    job_id = str(client.post("/v1/jobs", json=body).json()["id"])
    root = fake_run(api, job_id, status="succeeded")
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1.h").write_bytes(b"tb")
    mlflow = {"run_id": "r1", "experiment_id": "1", "url": "https://mlflow.example/#/runs/r1"}
    # A link the trainer reported is only followed when it is http(s).
    wandb = {"run_id": "job-1", "project": "p", "url": "javascript:window.__xss=3",
             "mode": "offline"}
    runs = {"tensorboard": {"logdir": "tensorboard"}, "mlflow": mlflow, "wandb": wandb}
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(tracking=runs))
        s.commit()

    page.goto(api.url + "/ui")
    use_key(page, api.key_a)
    page.goto(api.url + f"/ui#/jobs/{job_id}")
    page.wait_for_selector("#tracking")
    assert page.get_attribute("#tracking a", "href") == mlflow["url"]
    assert len(page.query_selector_all("#tracking a")) == 1
    assert "job-1 (offline)" in page.inner_text("#tracking")
    with page.expect_download() as download:
        page.click("#tensorboard")
    assert download.value.suggested_filename == f"{job_id}-tensorboard.zip"
    saved = tmp_path / "tb.zip"
    download.value.save_as(saved)
    with zipfile.ZipFile(saved) as zf:
        assert zf.namelist() == ["tensorboard/events.out.tfevents.1.h"]
    assert page.evaluate("window.__xss") is None
    assert page.problems == []


def test_a_dpo_job_shows_its_reward_curves(api: Api, page: Any) -> None:
    client = api.client(api.key_a)
    file_id = upload_rows(client, [{"prompt": f"q {i}", "chosen": "a", "rejected": "b"}
                                   for i in range(4)])
    body = job_body(file_id, training={"objective": "dpo", "max_steps": 4})
    body["dataset"]["format"] = "preference"
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id = str(r.json()["id"])
    fake_run(api, job_id, status="succeeded", log_lines=1, checkpoints=(4,), adapter=True)
    with api.session() as s:
        for step in range(1, 5):
            data = {"step": step, "total_steps": 4, "loss": 0.7 - step / 100,
                    "reward_chosen": step / 10, "reward_rejected": -step / 10,
                    "reward_margin": step / 5, "reward_accuracy": step / 4}
            s.add(JobEvent(job_id=job_id, type="progress", message=f"step {step}", data=data))
        s.execute(update(Job).where(Job.id == job_id).values(
            step=4, total_steps=4, preference_metrics={"reward_margin": 0.8,
                                                       "reward_accuracy": 1.0}))
        s.commit()
    page.goto(api.url + f"/ui#/jobs/{job_id}")
    use_key(page, api.key_a)
    page.wait_for_selector("svg.chart[aria-label='Rewards'] polyline")
    lines = page.eval_on_selector_all(
        "svg.chart[aria-label='Rewards'] polyline", "els => els.map(e => e.getAttribute('points'))"
    )
    assert [len(p.split()) for p in lines] == [4, 4, 4]  # chosen, rejected, margin
    assert page.query_selector("svg.chart[aria-label='Reward accuracy'] polyline") is not None
    text = page.inner_text("#view")
    assert "reward margin" in text and "dpo" in text
    assert page.problems == []


def test_a_grpo_job_shows_its_reward_curves_and_sampled_answers(api: Api, page: Any) -> None:
    client = api.client(api.key_a)
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}], "answer": "a"} for i in range(4)]
    grader = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "eq"}
    body = job_body(upload_rows(client, rows), training={
        "objective": "grpo", "max_steps": 4, "per_device_train_batch_size": 4,
        "grpo": {"grader": grader, "num_generations": 4}})
    body["dataset"]["format"] = "chat"
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id = str(r.json()["id"])
    fake_run(api, job_id, status="succeeded", log_lines=1, checkpoints=(4,), adapter=True)
    with api.session() as s:
        for step in range(1, 5):
            data = {"step": step, "total_steps": 4, "loss": 0.01, "reward": step / 5,
                    "reward_std": 0.1, "completion_length": 10 - step}
            s.add(JobEvent(job_id=job_id, type="progress", message=f"step {step}", data=data))
        s.add(JobEvent(job_id=job_id, type="eval", message="eval", data={
            "step": 4, "eval_loss": 0.0, "reward": 0.7}))
        s.add(JobEvent(job_id=job_id, type="grader", message="grader", data={
            "step": 4, "phase": "train", "scores": {},
            "samples": [{"row": 3, "prompt": "q 3", "completion": "<img src=x onerror=window.__xss=1>",
                         "reward": 0.0, "scores": {"exact": 0.0},
                         "errors": {"exact": "{{item.answer}}: no field 'answer'"}}],
            "graders": {"exact": {"calls": 16, "errors": 1, "out_of_range": 0,
                                  "last_error": "no field", "last_error_row": 3}}}))
        s.commit()
    page.goto(api.url + f"/ui#/jobs/{job_id}")
    use_key(page, api.key_a)
    page.wait_for_selector("svg.chart[aria-label='Reward'] polyline")
    lines = page.eval_on_selector_all(
        "svg.chart[aria-label='Reward'] polyline", "els => els.map(e => e.getAttribute('points'))"
    )
    assert [len(p.split()) for p in lines] == [4, 1]  # train, held-out
    assert page.query_selector("svg.chart[aria-label='Answer length (tokens)'] polyline")
    samples = page.inner_text("#samples")
    assert "<img src=x" in samples and "no field 'answer'" in samples
    assert "16" in page.inner_text("#graders")
    assert page.evaluate("window.__xss") is None
    assert page.problems == []


def test_a_job_evaluated_while_training_shows_its_scores_by_step(api: Api, page: Any) -> None:
    client = api.client(api.key_a)
    job_id = str(client.post("/v1/jobs", json=job_body(upload_rows(client, TEXT_ROWS)))
                 .json()["id"])
    fake_run(api, job_id, status="succeeded", log_lines=1, checkpoints=(5, 10), adapter=True)

    def score(stage: str, step: int | None, rate: float | None) -> dict[str, Any]:
        return {"stage": stage, "step": step, "model": f"m-{stage}-{step}", "eval_id": "eval-q",
                "run_id": "evalrun-x", "status": "completed", "result_counts": {},
                "criteria": {"exact": {"pass_rate": rate, "mean_score": rate},
                             "judged": {"pass_rate": None, "mean_score": None}}}

    best = "best by exact pass_rate of eval-q: m-checkpoints-5 (0.800; the others: ...)"
    evaluation = {"status": "completed", "scores": [
        score("base", None, 0.1), score("checkpoints", 5, 0.8), score("checkpoints", 10, 0.6),
        score("final", None, 0.6)], "best": {
        "model": "m-checkpoints-5", "step": 5, "eval_id": "eval-q", "criterion": "exact",
        "by": "pass_rate", "score": 0.8, "reason": best}}
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(step=STEP, total_steps=STEP,
                                                             evaluation=evaluation))
        s.commit()
    page.goto(api.url + f"/ui#/jobs/{job_id}")
    use_key(page, api.key_a)
    chart = "svg.chart[aria-label='Evaluation (pass rate)']"
    page.wait_for_selector(f"{chart} polyline")
    # One curve: "judged" graded nothing; base at step 0, the final model at the last step.
    (points,) = page.eval_on_selector_all(f"{chart} polyline",
                                          "els => els.map(e => e.getAttribute('points'))")
    assert len(points.split()) == 4
    assert "eval-q exact" in page.text_content(chart)
    assert page.inner_text("#evalbest") == best
    assert page.problems == []


def test_a_supervised_job_shows_no_reward_charts(api: Api, page: Any, finished_job: str) -> None:
    page.goto(api.url + f"/ui#/jobs/{finished_job}")
    use_key(page, api.key_a)
    page.wait_for_selector("svg.chart[aria-label='Loss'] polyline")
    assert page.query_selector("svg.chart[aria-label='Rewards']") is None


def test_dashboard_shows_workers_to_an_admin_key_only(api: Api, page: Any) -> None:
    from worker.upkeep.registry import Inventory, register

    with api.maker.begin() as s:
        register(s, "node-ui", Inventory("gpu-host", [{"index": 0, "name": "H100",
                                                        "memory_mb": 81559}], 16, {}, 1))
    page.goto(api.url + "/ui#/workers")
    use_key(page, api.key_b)  # a tenant key
    page.wait_for_selector("text=Workers are shown to admin keys only.")
    use_key(page, api.key_a)  # the bootstrap key: admin
    page.wait_for_selector("#workers td:has-text('node-ui')")
    row = page.inner_text("#workers tr:has-text('node-ui')")
    assert "gpu-host" in row and "H100" in row and "free" in row and "0 / 1" in row
    assert page.problems == []
