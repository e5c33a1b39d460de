"""The grading process's own start and end (core/run/grading_process.py): it makes the
socket's folder private, refuses one another user made, and on SIGUSR1 (what the SLURM
batch script sends once its trainer step ended) or SIGTERM removes its socket and folder
and ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.graders.config import GraderRuntime
from core.graders.service import RemoteGrading
from testkit.wait import wait_until
from tests.utils.jobdirs import make_job

EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "operation": "eq"}


def _plan(tmp_path: Path) -> Path:
    job = make_job(tmp_path, "/nonexistent-model",
                   [{"messages": [{"role": "user", "content": "x"}], "answer": "4"}],
                   spec={"dataset": {"format": "chat"},
                         "training": {"objective": "grpo", "per_device_train_batch_size": 4,
                                      "grpo": {"grader": EXACT, "num_generations": 4}}},
                   runtime={"graders": GraderRuntime().model_dump()})
    return job / "spec.json"


def _start(sock: Path, plan: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "core.run.grading_process", str(sock),
                             str(plan)], stderr=subprocess.PIPE)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_it_makes_its_folder_private_and_removes_it_when_signalled(
        tmp_path: Path, sig: signal.Signals) -> None:
    sock = tmp_path / "ftune-grading-7-0" / "grading.sock"
    proc = _start(sock, _plan(tmp_path))
    try:
        wait_until(lambda: sock.exists() or proc.poll() is not None, 60, "the socket")
        assert (sock.parent.stat().st_mode & 0o777, sock.stat().st_mode & 0o777) == (0o700,
                                                                                     0o600)
        client = RemoteGrading(str(sock))
        (score,) = client.grade_batch([("4", {"answer": "4"}, 1)])
        assert score.reward == 1.0
        proc.send_signal(sig)
        wait_until(lambda: not sock.exists(), 30, "it to stop listening")
        # A trainer still connected is served to its end: it closes, then the process ends.
        (score,) = client.grade_batch([("5", {"answer": "4"}, 2)])
        assert score.reward == 0.0
        client.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not sock.parent.exists()


def test_a_folder_another_user_made_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ftune-grading-7-0"
    folder.mkdir()
    os.chown(folder, 65534, 65534)  # made first by someone else, to listen in its place
    proc = _start(folder / "grading.sock", _plan(tmp_path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert b"is not this user's own folder" in err
    assert not (folder / "grading.sock").exists()
