"""Running one eval run on a worker: claim it, read its rows, skip the items it already has
(a resumed run), generate the answers of a completions run through the model's endpoint
with bounded concurrency while grading those that came back, write each output item as it
is graded, heart-beat (and stop when a cancel was asked), and end it with counts summed
from its items.

Grading runs on this thread, beside the requests in flight: python graders in their
sandbox, score_model and label_model through the judge endpoint."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.data.reading import DataFileError
from core.db.models import Eval, EvalRun, File
from core.evals import store
from core.evals.endpoint import Endpoint, EndpointResolver, EndpointUnavailable, engine_resolver
from core.evals.generate import USAGE_KEYS, Answer, Generator, Sampling
from core.evals.grading import CriteriaGrading
from core.evals.rows import Row, content_rows, file_rows, messages_for
from core.evals.spec import (
    CompletionsDataSource,
    Criterion,
    DataSource,
    FileContentSource,
    FileIdSource,
)
from core.graders.config import GraderRuntime
from core.infra.settings import Settings
from core.policy import Refused, stored_upload
from core.spec.grader_template import TemplateError

log = logging.getLogger("ftune.evals")
CRITERIA = TypeAdapter(list[Criterion])
DATA_SOURCE: TypeAdapter[Any] = TypeAdapter(DataSource)
NO_ERROR = {"code": "", "message": ""}
FLUSH_ITEMS = 32


class Ticker:
    """Writes graded items and heart-beats: at most every ``every`` seconds (or once
    FLUSH_ITEMS are waiting), carrying the seconds spent since. One commit per batch, not
    per item: on a busy machine a commit per item cost the run a third of its speed."""

    def __init__(self, maker: sessionmaker[Session], run: EvalRun, worker_id: str,
                 every: float) -> None:
        self.maker, self.run, self.worker_id, self.every = maker, run, worker_id, every
        self.run_id = run.id
        self.last = time.monotonic()
        self.generation = self.grading = 0.0
        self.cancel = False
        self.on_beat: Callable[[], None] | None = None
        self.pending: list[tuple[int, dict[str, Any], str, list[dict[str, Any]],
                                 dict[str, Any]]] = []

    def add(self, n: int, item: dict[str, Any], status: str, results: list[dict[str, Any]],
            sample: dict[str, Any]) -> None:
        self.pending.append((n, item, status, results, sample))

    def tick(self, force: bool = False) -> bool:
        """True once a cancel was asked."""
        if force or len(self.pending) >= FLUSH_ITEMS or time.monotonic() - self.last >= self.every:
            if self.pending:
                store.add_items(self.maker, self.run, self.pending)
                self.pending = []
            self.cancel = store.beat(self.maker, self.run_id, self.worker_id,
                                     generation_seconds=self.generation,
                                     grading_seconds=self.grading)
            self.generation = self.grading = 0.0
            self.last = time.monotonic()
            if self.on_beat is not None and not self.cancel:
                self.on_beat()
        return self.cancel


def execute_run(maker: sessionmaker[Session], run_id: str, *, worker_id: str,
                settings: Settings, resolver: EndpointResolver | None = None) -> str:
    """Claim and run ``run_id``; its final status, or "skipped" (another worker holds it,
    or it is not queued) or "lost" (taken from this worker while it ran)."""
    if not store.claim(maker, run_id, worker_id, settings.eval_stale_seconds):
        return "skipped"
    try:
        return _execute(maker, run_id, worker_id, settings,
                        resolver or engine_resolver(maker, settings))
    except store.RunLost:
        log.warning("eval run %s was taken from this worker", run_id)
        return "lost"
    except Exception as e:
        log.exception("eval run %s failed", run_id)
        store.finish(maker, run_id, worker_id, store.FAILED,
                     ("internal", f"{type(e).__name__}: {e}"))
        return store.FAILED


def _execute(maker: sessionmaker[Session], run_id: str, worker_id: str, settings: Settings,
             resolver: EndpointResolver) -> str:
    with maker() as session:
        run = session.get(EvalRun, run_id)
        assert run is not None
        ev = session.get(Eval, run.eval_id)
        assert ev is not None
        criteria = CRITERIA.validate_python(ev.testing_criteria)
        ds = DATA_SOURCE.validate_python(run.data_source)
        done = store.done_items(session, run_id)
        session.expunge_all()
    ticker = Ticker(maker, run, worker_id, settings.eval_heartbeat_seconds)
    if ticker.tick(force=True):
        store.finish(maker, run_id, worker_id, store.CANCELED)
        return store.CANCELED
    try:
        rows = [(n, r) for n, r in _rows(maker, run, ds, settings) if n not in done]
    except (DataFileError, Refused) as e:
        store.finish(maker, run_id, worker_id, store.FAILED, ("invalid_dataset", str(e)))
        return store.FAILED
    runtime = GraderRuntime.from_settings(settings)
    with CriteriaGrading(criteria, runtime) as grading:
        if isinstance(ds, CompletionsDataSource):
            def serve(wait: bool) -> Endpoint:
                return resolver(run.tenant_id, run.model, job_id=run.job_id,
                                waiting=lambda: wait and not ticker.tick(force=True))

            try:
                endpoint = serve(True)
            except EndpointUnavailable as e:
                if ticker.cancel:
                    store.finish(maker, run_id, worker_id, store.CANCELED)
                    return store.CANCELED
                store.finish(maker, run_id, worker_id, store.FAILED, (e.code, str(e)))
                return store.FAILED
            sampling = Sampling.of(ds.sampling_params)
            with Generator(endpoint, sampling, concurrency=settings.eval_concurrency,
                           timeout_seconds=settings.eval_request_timeout_seconds) as gen:
                ticker.on_beat = lambda: _keep_serving(gen, serve)
                outcome = _completions(maker, run, ds, rows, gen, grading, ticker)
                ticker.on_beat = None
        else:
            outcome = _given(maker, run, rows, grading, ticker)
    ticker.tick(force=True)
    store.finish(maker, run_id, worker_id, outcome)
    return outcome


def _keep_serving(gen: Generator, serve: Callable[[bool], Endpoint]) -> None:
    """At each heartbeat: the deployment counts as used (no scale to zero under a run),
    the adapter is loaded again if another model's evicted it, and a restarted engine's new
    address is followed. A failure here is the items' (they error), not the run's."""
    try:
        gen.retarget(serve(False))
    except EndpointUnavailable as e:
        log.warning("eval run: the model's deployment is not serving: %s", e)


def _rows(maker: sessionmaker[Session], run: EvalRun, ds: Any,
          settings: Settings) -> Iterator[tuple[int, Row]]:
    source = ds.source
    if isinstance(source, FileContentSource):
        yield from content_rows(source)
        return
    assert isinstance(source, FileIdSource)
    with maker() as session:
        f = session.scalar(select(File).where(File.id == source.id,
                                              File.tenant_id == run.tenant_id))
    if f is None:
        raise DataFileError(f"file {source.id} was deleted before the run read it")
    path = stored_upload(f.id, f.storage_path, settings, "data_source.source.id",
                         size=f.bytes, sha256=f.sha256)
    yield from file_rows(Path(path), settings.decompressed_limit)


def _given(maker: sessionmaker[Session], run: EvalRun, rows: list[tuple[int, Row]],
           grading: CriteriaGrading, ticker: Ticker) -> str:
    """A jsonl run: the rows' own samples graded."""
    for n, row in rows:
        if ticker.tick():
            return store.CANCELED
        text = str((row.get("sample") or {}).get("output_text", ""))
        graded = grading.grade(text, row["item"])
        ticker.grading += graded.seconds
        sample = _sample("", [], Answer(text), None)
        ticker.add(n, row["item"], graded.status, graded.results, sample)
    return store.COMPLETED


def _completions(maker: sessionmaker[Session], run: EvalRun, ds: CompletionsDataSource,
                 rows: list[tuple[int, Row]], gen: Generator, grading: CriteriaGrading,
                 ticker: Ticker) -> str:
    """Keep up to a few requests per slot queued (the engine batches what is in flight),
    grade each answer as it comes back."""
    window = 4 * gen.concurrency
    pending = iter(rows)
    in_flight: dict[Future[Answer], tuple[int, Row, list[dict[str, str]]]] = {}

    def fill() -> None:
        while len(in_flight) < window:
            nxt = next(pending, None)
            if nxt is None:
                return
            n, row = nxt
            try:
                messages = messages_for(ds, row["item"])
            except TemplateError as e:
                sample = _sample(run.model, [], Answer(None), gen.sampling,
                                 {"code": "invalid_item", "message": str(e)})
                ticker.add(n, row["item"], "error", [], sample)
                continue
            in_flight[gen.submit(messages)] = (n, row, messages)

    fill()
    while in_flight:
        t0 = time.perf_counter()
        finished, _ = wait(in_flight, timeout=ticker.every, return_when=FIRST_COMPLETED)
        ticker.generation += time.perf_counter() - t0
        for f in finished:
            n, row, messages = in_flight.pop(f)
            answer = f.result()
            if answer.error is not None or answer.text is None:
                sample = _sample(run.model, messages, answer, gen.sampling,
                                 {"code": "generation_failed", "message": answer.error or ""})
                ticker.add(n, row["item"], "error", [], sample)
                continue
            graded = grading.grade(answer.text, row["item"])
            ticker.grading += graded.seconds
            sample = _sample(run.model, messages, answer, gen.sampling)
            ticker.add(n, row["item"], graded.status, graded.results, sample)
        if ticker.tick():
            for f in in_flight:
                f.cancel()
            return store.CANCELED
        fill()
    return store.COMPLETED


def _sample(model: str, messages: list[dict[str, str]], answer: Answer,
            sampling: Sampling | None, error: dict[str, str] | None = None) -> dict[str, Any]:
    """OpenAI's output item sample: what was sent, what came back, with what parameters."""
    return {
        "model": model,
        "input": messages,
        "output": [] if answer.text is None else [{"role": "assistant",
                                                   "content": answer.text}],
        "finish_reason": answer.finish_reason,
        "usage": {k: int(answer.usage.get(k, 0)) for k in USAGE_KEYS},
        "error": error or NO_ERROR,
        "temperature": sampling.temperature if sampling else 1.0,
        "top_p": sampling.top_p if sampling else 1.0,
        "max_completion_tokens": sampling.max_completion_tokens if sampling else 0,
        "seed": sampling.seed or 0 if sampling else 0,
    }
