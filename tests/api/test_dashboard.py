"""The dashboard under /ui: static files with a CSP, and the page driven in headless Chromium
against the live service (Debian's /usr/bin/chromium through playwright; `make test`
installs it when it can, and the browser tests skip when it is missing)."""

from __future__ import annotations

import json
import re
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
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
from tests.utils.browser import CHROMIUM, CHROMIUM_FLAGS

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


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(
            "/usr/bin/chromium is missing: `apt-get install -y chromium` (make test does it "
            "when it runs as root)"
        )
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="ftune-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,  # a fresh --user-data-dir
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 1000},
            accept_downloads=True,
        )
        context.set_default_timeout(15_000)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    page = browser.new_page()
    page.problems = []  # CSP violations and uncaught script errors
    page.on(
        "console",
        lambda m: (
            page.problems.append(m.text)
            if m.type == "error" and "Content Security Policy" in m.text
            else None
        ),
    )
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    yield page
    page.close()


def use_key(page: Any, key: str) -> None:
    page.fill("#apikey", key)
    page.click("#keyform button[type=submit]")


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


def png_rgb(data: bytes) -> np.ndarray:
    """The pixels (height x width x RGB) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((height, width * bpp), np.uint8)
    prev = np.zeros(width * bpp, np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            prev = line
        elif kind == 1:  # Sub: a running sum along the row, per channel
            prev = np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # Up
            prev = line + prev
        else:  # Average, Paeth: byte by byte
            prev = np.frombuffer(_unfilter(kind, bytearray(line), prev.tobytes(), bpp), np.uint8)
        out[y] = prev
    return out.reshape(height, width, bpp)[:, :, :3]


def _unfilter(kind: int, line: bytearray, prev: bytes, bpp: int) -> bytearray:
    for i in range(len(line)):
        a = line[i - bpp] if i >= bpp else 0
        b = prev[i]
        if kind == 3:
            line[i] = (line[i] + (a + b) // 2) & 0xFF
            continue
        c = prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return line


def assert_real_screenshot(data: bytes) -> None:
    assert len(data) > 20_000, f"screenshot is only {len(data)} bytes"
    pixels = png_rgb(data)
    height, width, _ = pixels.shape
    assert width >= 1000 and height >= 800
    packed = pixels.astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], np.uint32)
    colors = np.unique(packed)
    # Text, charts, badges and the dark header: a blank or unstyled page has a handful.
    assert len(colors) > 50, f"only {len(colors)} colours in the screenshot"
    dark = (pixels.max(axis=2) < 60).mean()
    assert 0.01 < dark < 0.9, f"{dark:.1%} of the page is dark: header and text did not render"


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


# --------------------------------------------------------------------------- first-hour edges

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
