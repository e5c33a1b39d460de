"""Fuzz the API against its own OpenAPI document, larger than the CI test (tests/api/test_fuzz.py):
every operation, positive and negative cases, on a uvicorn process over SQLite or PostgreSQL.

    python -m bench.fuzz_api                       # ~150 cases per operation and mode, SQLite
    python -m bench.fuzz_api --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test

Prints requests, server errors and every distinct check failure (with a curl line to
reproduce it); exits 1 if there was any. Loopback only; bounded by --examples and --max-seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from bench.apiserver import RunningApi, running_api
from core.db.models import Checkpoint, Job, utcnow

CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
]


@dataclass
class Tally:
    examples: int
    derandomize: bool
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)  # distinct title -> first report


def seed(api: RunningApi) -> dict[str, list[str]]:
    """A file, a queued job and a succeeded job with checkpoints, log and adapter."""
    headers = {"Authorization": f"Bearer {api.key}"}
    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)).encode()
    with httpx.Client(base_url=api.url, headers=headers, timeout=30) as c:
        files = [
            c.post("/v1/files", files={"file": ("d.jsonl", rows)}).json()["id"] for _ in range(2)
        ]
        body = {
            "model": {"name_or_path": "org/tiny-model"},
            "dataset": {"file_id": files[0], "format": "text"},
            "training": {"max_steps": 10},
        }
        jobs = [c.post("/v1/jobs", json=body).json()["id"] for _ in range(2)]
    root = api.data_dir / "jobs" / jobs[1]
    (root / "adapter").mkdir(parents=True)
    (root / "trainer.log").write_text("".join(f"line {i}\n" for i in range(100)))
    for folder in ("adapter", "checkpoints/checkpoint-5"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "adapter_config.json").write_text('{"peft_type": "LORA"}')
        (root / folder / "adapter_model.safetensors").write_bytes(b"\0" * 1024)
    engine = create_engine(api.database_url)
    with Session(engine) as s:
        s.add(Checkpoint(job_id=jobs[1], step=5, path=str(root / "checkpoints/checkpoint-5")))
        s.execute(
            update(Job)
            .where(Job.id == jobs[1])
            .values(status="succeeded", job_dir=str(root), adapter_path=str(root / "adapter"),
                    started_at=utcnow(), finished_at=utcnow(), attempt=1,
                    launch={"argv": ["accelerate", "launch"], "accelerate_yaml": "a: 1\n"})
        )  # fmt: skip
        s.commit()
    engine.dispose()
    return {"job_id": jobs, "file_id": files}


def make_run(
    api: RunningApi,
    op: APIOperation,
    mode: GenerationMode,
    real: dict[str, list[str]],
    tally: Tally,
    deadline: float,
) -> Callable[[], None]:
    """A hypothesis test of one operation in one generation mode that never stops at a
    failure: it records it and goes on, so every run makes its full count of requests."""
    headers = {"Authorization": f"Bearer {api.key}"}
    label = f"{op.label} [{mode.value}]"

    @given(case=op.as_strategy(generation_mode=mode), data=st.data())
    @settings(
        max_examples=tally.examples,
        deadline=None,
        database=None,
        derandomize=tally.derandomize,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case, data: st.DataObject) -> None:
        if time.monotonic() > deadline:
            return
        for name, ids in real.items():
            if name in (case.path_parameters or {}) and data.draw(st.booleans()):
                case.path_parameters[name] = data.draw(st.sampled_from(ids))
        response = case.call(base_url=api.url, headers=headers, timeout=30)
        tally.requests += 1
        tally.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except FailureGroup as group:
            for failure in group.exceptions:
                tally.failures.setdefault(f"{label}: {failure.title}", str(failure)[:2000])
        except AssertionError as e:
            tally.failures.setdefault(f"{label}: {e}", str(e))

    return run  # type: ignore[no-any-return]


def fuzz(api: RunningApi, examples: int, max_seconds: float, derandomize: bool) -> Tally:
    real = seed(api)
    spec = httpx.get(api.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)
    tally = Tally(examples=examples, derandomize=derandomize)
    deadline = time.monotonic() + max_seconds
    operations = [r.ok() for r in schema.get_all_operations()]  # type: ignore[union-attr]
    for op in operations:
        for mode in GenerationMode:
            if time.monotonic() > deadline:
                return tally

            run = make_run(api, op, mode, real, tally, deadline)
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # hypothesis' seed notes
                    run()
            except Unsatisfiable:  # nothing to make invalid (an operation with no parameters)
                continue
            print(f"  {op.label:45} {mode.value:8} requests so far: {tally.requests}", flush=True)
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=150, help="cases per operation and mode")
    parser.add_argument("--database-url", default=None, help="a PostgreSQL server (a scratch "
                        "database is created on it and dropped); default SQLite")  # fmt: skip
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--derandomize", action="store_true", help="the CI test's cases")
    args = parser.parse_args()
    started = time.monotonic()
    with running_api(args.database_url, log_level="WARNING") as api:
        print(f"fuzzing {api.url} ({api.database_url.split(':')[0]})", flush=True)
        tally = fuzz(api, args.examples, args.max_seconds, args.derandomize)
        server_log = api.log_path.read_text()
    elapsed = time.monotonic() - started
    server_errors = sum(n for status, n in tally.statuses.items() if status >= 500)
    print(f"\nrequests: {tally.requests} in {elapsed:.0f} s")
    print("statuses: " + ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items())))
    print(f"server errors (5xx): {server_errors}")
    print(f"distinct check failures: {len(tally.failures)}")
    for title, report in tally.failures.items():
        print(f"\n--- {title}\n{report}")
    if "Traceback" in server_log:
        print("\n--- the server logged tracebacks:\n" + server_log[-6000:])
    return 1 if tally.failures or server_errors else 0


if __name__ == "__main__":
    sys.exit(main())
