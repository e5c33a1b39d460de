"""Enqueueing, and the Celery configuration it relies on."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from queue import Empty

import pytest

from core.infra.broker import RUN_JOB_TASK, celery_config
from core.infra.settings import Settings
from core.jobs.dispatch import enqueue_job
from testkit.launch import REPO_ROOT
from tests.utils.worker import WorkerEnv


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
    # Written under a partial name and renamed (core/infra/fs_transport.py): none is left over.
    assert files[0].name.endswith(f".{wenv.settings.queue_name}.msg")


def test_dispatch_imports_no_torch() -> None:
    code = ("import sys, core.jobs.dispatch; "
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


def test_filesystem_broker_polls_its_folder_often(wenv: WorkerEnv) -> None:
    # kombu's own default is once a second: half a second of dispatch latency on average.
    from core.infra.broker import FILESYSTEM_POLL_SECONDS, create_app

    with create_app(wenv.settings, include_tasks=False).connection_for_read() as conn:
        assert conn.transport.polling_interval == FILESYSTEM_POLL_SECONDS <= 0.1


def test_a_message_being_written_is_not_consumed(wenv: WorkerEnv) -> None:
    # What the atomic write relies on: kombu's consumer skips a file under the partial name
    # (a half-written message read as empty JSON killed the worker).
    from core.infra.broker import create_app, ensure_broker_dirs
    from core.infra.fs_transport import Transport

    ensure_broker_dirs(wenv.settings)
    folder = wenv.settings.broker_dir / "messages"
    queue = wenv.settings.queue_name
    (folder / f"1_partial.{queue}.msg.partial").write_bytes(b"")
    with create_app(wenv.settings, include_tasks=False).connection_for_read() as conn:
        assert isinstance(conn.transport, Transport)
        with pytest.raises(Empty):
            conn.default_channel._get(queue)
    assert [p.name for p in folder.iterdir()] == [f"1_partial.{queue}.msg.partial"]
