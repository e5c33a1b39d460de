"""A typed, synchronous Python client for the ftune REST API (what the `ftune` CLI uses).

    from client import FtuneClient
    c = FtuneClient("http://127.0.0.1:8000", api_key="ft_...")
    f = c.upload_file("train.jsonl")
    job = c.create_job({"model": {...}, "dataset": {"file_id": f["id"]}})
    job = c.wait(job["id"])
    c.download_adapter(job["id"], "adapter.zip")
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self, TypedDict

import httpx

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class Progress(TypedDict, total=False):
    step: int
    total_steps: int | None
    epoch: float | None
    percent: float | None
    eta_seconds: float | None


class Metrics(TypedDict, total=False):
    train_loss: float | None
    eval_loss: float | None
    learning_rate: float | None
    tokens_per_second: float | None
    peak_memory_mb: float | None
    preference: dict[str, float | None] | None


class JobError(TypedDict):
    code: str
    message: str


class Job(TypedDict, total=False):
    id: str
    name: str | None
    status: str
    created_at: str
    started_at: str | None
    finished_at: str | None
    spec: dict[str, Any]  # the spec that runs: defaults filled, target modules resolved
    request: dict[str, Any]  # the body as sent
    run: dict[str, Any] | None
    usage: dict[str, Any]
    progress: Progress
    phase: dict[str, Any] | None  # before the first step: queued, loading_model, ...
    metrics: Metrics
    checkpoints_count: int
    adapter_available: bool
    model_available: bool
    attempt: int
    error: JobError | None


class FileObject(TypedDict, total=False):
    id: str
    filename: str
    format: str
    bytes: int
    rows: int
    columns: list[str]
    created_at: int  # unix seconds (OpenAI's file object)


class Event(TypedDict, total=False):
    id: int
    created_at: str
    type: str
    message: str
    data: dict[str, Any]


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class FtuneAPIError(Exception):
    """An error answer from the API, with its code, message and offending field."""

    def __init__(self, status: int, body: Any) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status = status
        self.code: str = err.get("code", "http_error")
        self.message: str = err.get("message", str(body))
        self.param: str | None = err.get("param")
        self.details: list[dict[str, Any]] = err.get("details") or []
        lines = [f"{status} {self.code}: {self.message}"]
        lines += [f"  - {d.get('param')}: {d.get('message')}" for d in self.details]
        super().__init__("\n".join(lines))


class FtuneClient:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 60.0) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _json(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = resp.text
            raise FtuneAPIError(resp.status_code, body)
        return resp.json()

    # Files
    def upload_file(self, path: str | Path) -> FileObject:
        p = Path(path)
        with open(p, "rb") as f:
            return self._json(self._http.post("/v1/files", files={"file": (p.name, f)}))

    def list_files(self) -> list[FileObject]:
        return self._json(self._http.get("/v1/files"))["data"]

    def delete_file(self, file_id: str) -> None:
        self._json(self._http.delete(f"/v1/files/{file_id}"))

    # Jobs
    def create_job(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> Job:
        # An idempotency key by default: a retried POST (timeout, API restart) returns the
        # same job instead of starting a second run.
        key = idempotency_key or uuid.uuid4().hex
        for attempt in range(3):
            try:
                resp = self._http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": key})
                return self._json(resp)
            except httpx.TransportError:
                if attempt == 2:
                    raise
                time.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    def estimate(self, spec: dict[str, Any], preview: int = 3) -> dict[str, Any]:
        """A dry run: the submit's checks, nothing recorded; tokens, steps, memory, time,
        the data format read and the first ``preview`` rows as the trainer renders them."""
        params = {"dry_run": "true", "preview": str(preview)}
        return self._json(self._http.post("/v1/jobs", params=params, json=spec))

    def validate_grader(self, grader: dict[str, Any]) -> dict[str, Any]:
        """Check a grader (OpenAI's shape): the grader with defaults, and the item fields
        its templates need; FtuneAPIError lists every problem."""
        return self._json(self._http.post("/v1/graders/validate", json={"grader": grader}))

    def run_grader(
        self, grader: dict[str, Any], model_sample: str, item: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Grade one answer against one dataset row: reward, sub_rewards, errors."""
        body = {"grader": grader, "model_sample": model_sample, "item": item or {}}
        return self._json(self._http.post("/v1/graders/run", json=body))

    def compare_runs(self, eval_id: str, base_run_id: str, candidate_run_id: str, *,
                     seed: int = 0, resamples: int = 2000) -> dict[str, Any]:
        """Two runs of an eval side by side (GET /v1/evals/{eval_id}/compare)."""
        params: dict[str, str | int] = {"base_run_id": base_run_id, "seed": seed,
                                        "candidate_run_id": candidate_run_id,
                                        "resamples": resamples}
        return dict(self._json(self._http.get(f"/v1/evals/{eval_id}/compare", params=params)))

    def usage(self, start: str | None = None, end: str | None = None) -> dict[str, Any]:
        """Usage by UTC day (YYYY-MM-DD bounds, inclusive)."""
        params = {k: v for k, v in (("from", start), ("to", end)) if v is not None}
        return self._json(self._http.get("/v1/usage", params=params))

    def get_job(self, job_id: str) -> Job:
        return self._json(self._http.get(f"/v1/jobs/{job_id}"))

    def list_jobs(
        self, *, status: str | None = None, limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if after:
            params["after"] = after
        return self._json(self._http.get("/v1/jobs", params=params))

    def list_deployments(self) -> list[dict[str, Any]]:
        """The engine servers (admin keys only)."""
        return list(self._json(self._http.get("/v1/deployments"))["data"])

    def stop_deployment(self, deployment_id: str) -> dict[str, Any]:
        """Stop a deployment now (admin keys only); the next request starts it again."""
        return dict(self._json(self._http.post(f"/v1/deployments/{deployment_id}/stop")))

    def cancel_job(self, job_id: str) -> Job:
        return self._json(self._http.post(f"/v1/jobs/{job_id}/cancel"))

    def pause_job(self, job_id: str) -> Job:
        return self._json(self._http.post(f"/v1/jobs/{job_id}/pause"))

    def resume_job(
        self, job_id: str, *, num_processes: int | None = None, strategy: str | None = None
    ) -> Job:
        """Resume a paused job; on another process count / strategy when given."""
        body = {k: v for k, v in (("num_processes", num_processes), ("strategy", strategy))
                if v is not None}  # fmt: skip
        return self._json(self._http.post(f"/v1/jobs/{job_id}/resume", json=body or None))

    def events(self, job_id: str, *, after: int | None = None, limit: int = 500) -> list[Event]:
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return self._json(self._http.get(f"/v1/jobs/{job_id}/events", params=params))["data"]

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._json(self._http.get(f"/v1/jobs/{job_id}/checkpoints"))["data"]

    def logs(self, job_id: str, *, tail: int = 200) -> list[str]:
        return self._json(self._http.get(f"/v1/jobs/{job_id}/logs", params={"tail": tail}))[
            "lines"
        ]

    def launch(self, job_id: str) -> dict[str, Any]:
        return self._json(self._http.get(f"/v1/jobs/{job_id}/launch"))

    def download_adapter(
        self, job_id: str, dest: str | Path, *, checkpoint: int | None = None
    ) -> Path:
        """Stream the adapter zip to ``dest`` (written to a .part file, then renamed)."""
        params = {"checkpoint": checkpoint} if checkpoint is not None else None
        return self._download(f"/v1/jobs/{job_id}/adapter", Path(dest), params)

    def download_tensorboard(self, job_id: str, dest: str | Path) -> Path:
        """Stream the zip of the job's TensorBoard event files to ``dest``."""
        return self._download(f"/v1/jobs/{job_id}/tensorboard", Path(dest), None)

    def model_files(self, job_id: str, *, checkpoint: int | None = None) -> dict[str, Any]:
        """The files of a fully fine-tuned model (or of its checkpoint at step
        ``checkpoint``): ``data`` [{name, bytes, sha256, url}]."""
        params = {"checkpoint": checkpoint} if checkpoint is not None else None
        return self._json(self._http.get(f"/v1/jobs/{job_id}/model", params=params))

    def download_model(
        self,
        job_id: str,
        dest: str | Path,
        *,
        on_bytes: Callable[[int], None] | None = None,
        on_listing: Callable[[dict[str, Any]], None] | None = None,
        checkpoint: int | None = None,
    ) -> list[Path]:
        """Every file of a fully fine-tuned model into the directory ``dest``, which
        ``AutoModelFor*.from_pretrained(dest)`` then loads. Resumable: a file already there
        with its listed sha256 is kept, a partial one (``<name>.part``, left by an
        interrupted download) continues with an HTTP Range request from where it stopped.
        Each file's sha256 is checked before it gets its name. ``on_bytes``: called with
        the bytes of each chunk (those kept from earlier too), for a progress bar.
        ``checkpoint``: the model at that checkpoint's step instead of the final one."""
        folder = Path(dest)
        folder.mkdir(parents=True, exist_ok=True)
        listing = self.model_files(job_id, checkpoint=checkpoint)
        params = {"checkpoint": checkpoint} if checkpoint is not None else None
        if on_listing:
            on_listing(listing)
        out = []
        for entry in listing["data"]:
            name, size, sha = str(entry["name"]), int(entry["bytes"]), str(entry["sha256"])
            if "/" in name or name in ("", ".", ".."):
                raise FtuneAPIError(0, f"the listing names an unsafe file: {name!r}")
            final, part = folder / name, folder / (name + ".part")
            if final.is_file() and final.stat().st_size == size and _sha256(final) == sha:
                if on_bytes:
                    on_bytes(size)
                out.append(final)
                continue
            offset = part.stat().st_size if part.is_file() else 0
            if offset > size:
                offset = 0  # not a prefix of this file: start again
            if offset and on_bytes:
                on_bytes(offset)
            if offset < size:
                headers = {"Range": f"bytes={offset}-"} if offset else {}
                with self._http.stream("GET", f"/v1/jobs/{job_id}/model/{name}",
                                       headers=headers, params=params) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        self._json(resp)
                    # 200: the server sent the whole file (it ignored the range).
                    mode = "ab" if resp.status_code == 206 else "wb"
                    with open(part, mode) as f:
                        for chunk in resp.iter_bytes():
                            f.write(chunk)
                            if on_bytes:
                                on_bytes(len(chunk))
            if _sha256(part) != sha:
                part.unlink()
                raise FtuneAPIError(0, f"{name}: downloaded bytes do not match its sha256; "
                                       "run the download again")
            part.replace(final)
            out.append(final)
        return out

    def _download(self, path: str, dest: Path, params: dict[str, Any] | None) -> Path:
        part = dest.with_name(dest.name + ".part")
        with self._http.stream("GET", path, params=params) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._json(resp)
            with open(part, "wb") as f:
                f.writelines(resp.iter_bytes())
        part.replace(dest)
        return dest

    def follow(self, job_id: str, *, poll_seconds: float = 1.0) -> Iterator[Job]:
        """Yield the job each time it is polled, until it is terminal (the last one yielded)."""
        while True:
            job = self.get_job(job_id)
            yield job
            if job["status"] in TERMINAL:
                return
            time.sleep(poll_seconds)

    def wait(
        self,
        job_id: str,
        *,
        poll_seconds: float = 1.0,
        timeout: float | None = None,
        on_update: Callable[[Job], None] | None = None,
    ) -> Job:
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.follow(job_id, poll_seconds=poll_seconds):
            if on_update:
                on_update(job)
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")
        raise AssertionError("unreachable")

    # Webhooks
    def create_webhook(
        self, url: str, *, event_types: list[str] | None = None, description: str = ""
    ) -> dict[str, Any]:
        """Register an endpoint; the answer's ``secret`` (``whsec_...``) is shown only here."""
        body: dict[str, Any] = {"url": url, "description": description}
        if event_types is not None:
            body["event_types"] = event_types
        return self._json(self._http.post("/v1/webhooks", json=body))

    def list_webhooks(self) -> list[dict[str, Any]]:
        return self._json(self._http.get("/v1/webhooks", params={"limit": 100}))["data"]

    def delete_webhook(self, webhook_id: str) -> None:
        self._json(self._http.delete(f"/v1/webhooks/{webhook_id}"))

    def webhook_deliveries(self, webhook_id: str, *, limit: int = 100) -> list[dict[str, Any]]:
        return self._json(
            self._http.get(f"/v1/webhooks/{webhook_id}/deliveries", params={"limit": limit})
        )["data"]

    def test_webhook(self, webhook_id: str) -> dict[str, Any]:
        """Queue a ``webhook.test`` event to the endpoint; returns its pending delivery."""
        return self._json(self._http.post(f"/v1/webhooks/{webhook_id}/test"))
