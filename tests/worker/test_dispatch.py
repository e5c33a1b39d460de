"""Enqueueing, and the Celery configuration it relies on."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

from core.broker import RUN_JOB_TASK, celery_config
from core.dispatch import enqueue_job
from core.settings import Settings
from tests.conftest import REPO_ROOT
from tests.worker.conftest import WorkerEnv


def test_enqueue_on_the_filesystem_broker_writes_one_message(wenv: WorkerEnv) -> None:
    enqueue_job("job-123")

    folder = wenv.settings.broker_dir / "messages"
    files = list(folder.iterdir())
    assert len(files) == 1
    message = json.loads(files[0].read_text())
    body = json.loads(base64.b64decode(message["body"]))
    assert message["headers"]["task"] == RUN_JOB_TASK
    assert body[0] == ["job-123"]
    assert message["properties"]["delivery_info"]["routing_key"] == wenv.settings.queue_name


def test_dispatch_imports_no_torch() -> None:
    code = ("import sys, core.dispatch; "
            "print('torch' in sys.modules, 'worker.queue.tasks' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_redis_config_acks_early_without_prefetch() -> None:
    cfg = celery_config(Settings(BROKER_URL="redis://localhost:6379/0", queue_name="gpu-a100"))
    assert cfg["task_acks_late"] is False
    assert cfg["worker_prefetch_multiplier"] == 1 and cfg["worker_disable_prefetch"] is True
    assert cfg["task_default_queue"] == "gpu-a100"
    assert cfg["result_backend"] is None and cfg["worker_send_task_events"] is True
    assert cfg["broker_connection_retry_on_startup"] is True
