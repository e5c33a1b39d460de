"""The watch loop's own mechanics: events reach the database only when the trainer wrote
some, and the loop wakes when the trainer exits."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event

from core.db.models import JobStatus, utcnow
from core.db.session import get_engine
from core.run.jobdir import JobDir
from tests.utils.worker import WorkerEnv, events_of, job_spec, make_job
from worker.run import process_tree
from worker.run.claim import Claim
from worker.run.watch import ExitWaiter, Watch


def _append(path: Path, *events: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))


@contextmanager
def _statements() -> Iterator[list[str]]:
    """Every SQL statement the engine runs inside the block."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _watch(w: WorkerEnv) -> Watch:
    job_id = make_job(job_spec(w.model_root, path=w.data_root / "x.jsonl"),
                      status=JobStatus.running, worker_id="w1", attempt=1)
    jd = JobDir(w.settings.jobs_dir / job_id)
    jd.root.mkdir(parents=True)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    launched = process_tree.Launched(popen=done, tag="test")
    claim = Claim(job_id, "tenant", "w1", 1, None, utcnow())
    return Watch(claim, w.settings, jd, launched, deadline=None)


def test_ingest_touches_the_database_only_when_events_were_appended(wenv: WorkerEnv) -> None:
    watch = _watch(wenv)
    _append(watch.jd.events, {"time": 1.0, "type": "started", "total_steps": 4},
            {"time": 2.0, "type": "progress", "step": 1, "total_steps": 4})
    watch.ingest()
    assert [e.type for e in events_of(watch.job_id)] == ["started", "progress"]

    with _statements() as seen:
        watch.ingest()  # the trainer wrote nothing since
    assert seen == []

    _append(watch.jd.events, {"time": 3.0, "type": "progress", "step": 2, "total_steps": 4})
    with _statements() as seen:
        watch.ingest()
    assert seen
    assert [e.type for e in events_of(watch.job_id)] == ["started", "progress", "progress"]


def test_ingest_before_the_trainer_wrote_anything_reads_the_job_once(wenv: WorkerEnv) -> None:
    watch = _watch(wenv)  # no events.jsonl yet
    with _statements() as seen:
        watch.ingest()
    assert seen  # the first look always asks the database (the offset lives there)
    with _statements() as seen:
        watch.ingest()
    assert seen == []
    _append(watch.jd.events, {"time": 1.0, "type": "started", "total_steps": 4})
    watch.ingest()
    assert [e.type for e in events_of(watch.job_id)] == ["started"]


def test_exit_waiter_wakes_when_the_process_exits() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    waiter = ExitWaiter(p)
    try:
        started = time.monotonic()
        waiter.wait(120)
        # Well before the timeout: it woke at the exit, not at the end of its wait.
        assert time.monotonic() - started < 60
        assert p.wait(timeout=5) == 0
    finally:
        waiter.close()
        p.kill()
        p.wait()


def test_exit_waiter_returns_at_the_timeout_while_the_process_runs() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    waiter = ExitWaiter(p)
    try:
        waiter.wait(0.2)
        assert p.poll() is None
    finally:
        waiter.close()
        p.kill()
        p.wait()
