"""The dashboard's first-hour edges, in headless Chromium against the live service (as
tests/api/test_dashboard.py): a cancelled job's checkpoints, legends and axes that fit, the
latest attempt's memory, a long name, what a job does before its first step, the submit
form's data preview."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from core.db.models import Job, JobEvent, utcnow
from tests.api.jobfixtures import ADAPTER_FILES, fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows
from tests.utils.browser import use_key

# A name with no space to break at, longer than any screen is wide.
LONG_NAME = "run-" + "x" * 190
# A learning rate whose plain decimal form ("0.00000123") is wider than the room left of the
# y axis.
TINY_LR = 1.23e-6


@pytest.fixture(scope="module")
def retried_cancelled_job(api: Api) -> str:
    """Cancelled in its second attempt, with checkpoints, no eval data, a tiny learning rate
    and memory figures from both attempts."""
    client = api.client(api.key_a)
    file_id = upload_rows(client, TEXT_ROWS)
    job_id = str(client.post("/v1/jobs", json=job_body(file_id, name=LONG_NAME)).json()["id"])
    fake_run(api, job_id, status="cancelled", checkpoints=(5, 10))
    with api.session() as s:
        for attempt, peak in ((1, 111.0), (2, 222.0)):
            s.add(JobEvent(job_id=job_id, type="phase", message="preparing data",
                           data={"phase": "preparing_data", "attempt": attempt}))
            s.add(JobEvent(job_id=job_id, type="memory", message="",
                           data={"phase": "train", "rank": 0, "cpu_mb_peak": peak}))
        for step in range(1, 11):
            s.add(JobEvent(job_id=job_id, type="progress", message=f"step {step}",
                           data={"step": step, "total_steps": 20, "loss": 2.0 / step,
                                 "learning_rate": TINY_LR * step}))
        s.execute(update(Job).where(Job.id == job_id)
                  .values(attempt=2, step=10, total_steps=20, finished_at=utcnow()))
        s.commit()
    return job_id


def open_job(api: Api, page: Any, job_id: str) -> None:
    page.goto(f"{api.url}/ui#/jobs/{job_id}")
    use_key(page, api.key_a)
    page.wait_for_selector("svg.chart[aria-label='Loss'] polyline")


def test_a_cancelled_job_offers_each_checkpoint_for_download(
    api: Api, page: Any, retried_cancelled_job: str, tmp_path: Path
) -> None:
    open_job(api, page, retried_cancelled_job)
    assert page.query_selector("#download") is None  # no final adapter
    with page.expect_download() as download:
        page.click("#checkpoints button.ckpt[data-step='10']")
    assert download.value.suggested_filename == f"{retried_cancelled_job}-checkpoint-10.zip"
    saved = tmp_path / "checkpoint.zip"
    download.value.save_as(saved)
    with zipfile.ZipFile(saved) as zf:
        assert {n: zf.read(n) for n in zf.namelist()} == ADAPTER_FILES
    assert page.problems == []


def test_the_loss_legend_names_only_curves_with_data(
    api: Api, page: Any, retried_cancelled_job: str
) -> None:
    open_job(api, page, retried_cancelled_job)
    legend = page.eval_on_selector("svg.chart[aria-label='Loss'] text:has(tspan)",
                                   "e => e.textContent")
    assert "train" in legend and "eval" not in legend


def test_learning_rate_axis_labels_fit_inside_the_chart(
    api: Api, page: Any, retried_cancelled_job: str
) -> None:
    open_job(api, page, retried_cancelled_job)
    boxes = page.eval_on_selector_all(
        "svg.chart[aria-label='Learning rate'] text",
        "els => els.map(e => { const b = e.getBBox(); return [e.textContent, b.x, b.x + b.width]; })")
    width = page.eval_on_selector("svg.chart[aria-label='Learning rate']",
                                  "e => e.viewBox.baseVal.width")
    assert any(text.startswith("1.23e-") for text, _, _ in boxes), boxes
    for text, left, right in boxes:
        assert 0 <= left and right <= width, (text, left, right)


def test_memory_is_said_to_be_the_latest_attempts(
    api: Api, page: Any, retried_cancelled_job: str
) -> None:
    open_job(api, page, retried_cancelled_job)
    card = page.inner_text(".card:has(h3:has-text('Memory'))")
    assert card.startswith("Memory (MB) of attempt 2")
    assert "222" in card and "111" not in card


def test_a_long_name_does_not_push_the_page_sideways(
    api: Api, page: Any, retried_cancelled_job: str
) -> None:
    page.set_viewport_size({"width": 800, "height": 900})
    open_job(api, page, retried_cancelled_job)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    page.goto(f"{api.url}/ui#/")
    page.wait_for_selector(f"#jobs a[href='#/jobs/{retried_cancelled_job}']")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_a_job_says_what_it_does_before_its_first_step(api: Api, page: Any) -> None:
    client = api.client(api.key_a)
    job_id = str(client.post("/v1/jobs", json=job_body(upload_rows(client, TEXT_ROWS))
                             ).json()["id"])
    assert client.get(f"/v1/jobs/{job_id}").json()["phase"] == {
        "phase": "queued", "message": "queued: waiting for a worker", "loaded": None,
        "total": None, "shards": None}
    fake_run(api, job_id, status="running")
    assert client.get(f"/v1/jobs/{job_id}").json()["phase"]["phase"] == "starting"
    loading = {"phase": "loading_model", "message": "loading model: 3 of 21 tensors (1 shard file)",
               "attempt": 1, "loaded": 3, "total": 21, "shards": 1}
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(phase=loading))
        s.commit()
    phase = client.get(f"/v1/jobs/{job_id}").json()["phase"]
    assert phase == {k: v for k, v in loading.items() if k != "attempt"}
    page.goto(f"{api.url}/ui#/jobs/{job_id}")
    use_key(page, api.key_a)
    page.wait_for_selector("#phase")
    assert page.inner_text("#phase") == "loading model: 3 of 21 tensors (1 shard file)"
    assert page.problems == []


def test_submit_form_previews_the_data_as_the_trainer_renders_it(api: Api, page: Any) -> None:
    # The server thread shares this process: import what a dry run needs before the click.
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from tests.utils import samples
    from tests.utils.tiny import build_causal_lm

    model = build_causal_lm(api.settings.allowed_model_roots[0] / "tiny-llama-preview")
    client = api.client(api.key_a)
    file_id = upload_rows(client, [samples.OPENAI_WEIGHTED])
    page.goto(api.url + "/ui#/new")
    use_key(page, api.key_a)
    page.wait_for_selector("#spec")
    spec = {"model": {"name_or_path": str(model)}, "dataset": {"file_id": file_id}}
    page.fill("#spec", json.dumps(spec))
    page.click("#preview")
    page.wait_for_selector("#receipt, #submiterr:has-text('4')", timeout=60_000)
    assert page.inner_text("#submiterr") == ""
    assert "Data: chat [openai_chat], detected; columns used: messages (messages)" in (
        page.inner_text("#receipt")
    )
    est = client.post("/v1/jobs", params={"dry_run": "true", "preview": 1}, json=spec).json()
    want = est["preview"][0]["loss_tokens"]
    assert page.locator("pre.tokens .loss").count() == want > 0
    assert page.problems == []


@pytest.fixture(scope="module")
def measured_job(api: Api) -> str:
    """A finished job whose one attempt measured each phase at several evaluations."""
    client = api.client(api.key_a)
    file_id = upload_rows(client, TEXT_ROWS)
    job_id = str(client.post("/v1/jobs", json=job_body(file_id)).json()["id"])
    fake_run(api, job_id, status="cancelled", checkpoints=(5, 10))
    with api.session() as s:
        s.add(JobEvent(job_id=job_id, type="phase", message="preparing data",
                       data={"phase": "preparing_data", "attempt": 1}))
        for peak in (300.0, 500.0, 400.0):
            for rank in (0, 1):
                s.add(JobEvent(job_id=job_id, type="memory", message="",
                               data={"phase": "eval", "rank": rank, "cpu_mb_peak": peak + rank}))
        for step in (1, 2):
            s.add(JobEvent(job_id=job_id, type="progress", message=f"step {step}",
                           data={"step": step, "total_steps": 10, "loss": 1.0 / step}))
        s.execute(update(Job).where(Job.id == job_id).values(attempt=1, step=2,
                                                             finished_at=utcnow()))
        s.commit()
    return job_id


def test_memory_shows_one_peak_per_phase_and_rank_and_reads_in_events(
        api: Api, page: Any, measured_job: str) -> None:
    page.set_viewport_size({"width": 1400, "height": 900})
    open_job(api, page, measured_job)
    rows = page.eval_on_selector_all(
        ".card:has(h3:has-text('Memory')) tbody tr",
        "trs => trs.map(tr => [...tr.cells].slice(0, 3).map(c => c.textContent))")
    assert rows == [["eval", "0", "500"], ["eval", "1", "501"]]
    events = page.inner_text("#events")
    assert "memory eval (rank 0): CPU peak 500 MB" in events and "cpu_mb_peak" not in events


def test_checkpoint_download_buttons_keep_their_word_whole(
        api: Api, page: Any, measured_job: str) -> None:
    page.set_viewport_size({"width": 1400, "height": 900})
    open_job(api, page, measured_job)
    heights = page.eval_on_selector_all(
        "#checkpoints button.ckpt", "bs => bs.map(b => [b.getClientRects().length, "
        "b.getBoundingClientRect().height, parseFloat(getComputedStyle(b).lineHeight) || 20])")
    assert heights
    for rects, height, line in heights:
        assert rects == 1 and height < 2 * line, (height, line)  # one line: "Download"
