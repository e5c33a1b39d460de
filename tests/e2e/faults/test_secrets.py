"""No credential reaches a log or the trainer. Its file's name sorts last in the package:
every fault test before it has written its logs on the same stack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client import FtuneClient
from testkit.faultstack import (
    FaultStack,
    PgDatabase,
    RedisServer,
)
from tests.utils.faults import (
    fake_spec,
    job_dir,
)

pytestmark = pytest.mark.e2e


def test_no_secret_reaches_a_log_or_the_trainer(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        database: PgDatabase, tiny_causal_lm: Path, lm_file: str) -> None:
    """Runs last (this file sorts last in the package): every log of the faults before it is
    checked for the credentials."""
    job = client.wait(client.create_job(fake_spec(tiny_causal_lm, lm_file, "env"))["id"],
                      timeout=60, poll_seconds=0.3)
    assert job["status"] == "succeeded", job["error"]
    env = json.loads((job_dir(stack, job["id"]) / "env.json").read_text())
    secrets_ = {"database password": database.password, "redis password": redis_server.password,
                "API key": stack.api_key}
    for what, value in secrets_.items():
        assert not [k for k, v in env.items() if value in v], f"{what} in the trainer's env"
    assert not {"DATABASE_URL", "BROKER_URL", "FTUNE_BOOTSTRAP_API_KEY"} & set(env)

    logs = stack.log_text()
    trainer_logs = "\n".join(p.read_text(errors="replace")
                             for p in (stack.data_dir / "jobs").glob("*/trainer.log"))
    for what, value in secrets_.items():
        assert value not in logs, f"{what} in a service log"
        assert value not in trainer_logs, f"{what} in a trainer log"
    assert "ftune worker ready: database postgresql+psycopg://postgres:***@" in logs
    assert f"redis://:***@127.0.0.1:{redis_server.port}/0" in logs
