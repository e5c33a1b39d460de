"""Python graders in their sandbox: each limit proven by a grader that tries to break it.
Every such grader gets no score and an error saying why; the host is unharmed (no process of
the sandbox user survives, the next call of the same grader works)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.graders.sandbox import PythonSandbox, SandboxLimits, sandbox_refusal

pytestmark = pytest.mark.skipif(sandbox_refusal() is not None, reason=str(sandbox_refusal()))

LIMITS = SandboxLimits(wall_seconds=5, cpu_seconds=2, memory_bytes=512 << 20, processes=16)
GOOD = "def grade(sample, item):\n    return 1.0 if sample['output_text'] == item['a'] else 0.0\n"


def run(source: str, limits: SandboxLimits = LIMITS) -> tuple[str | None, float | None]:
    """(error of a hostile call, score of a good call right after it in the same sandbox)."""
    with PythonSandbox(source + "\n" + _SWITCH, limits) as sb:
        bad = sb.call({"output_text": "attack"}, {"a": "x"})
        good = sb.call({"output_text": "x"}, {"a": "x"})
    assert bad.score is None
    return bad.error, good.score


# After the attack, the same grader answers normally: the sandbox is restarted if it died.
_SWITCH = """
_attack = grade
def grade(sample, item):
    if sample["output_text"] == "attack":
        return _attack(sample, item)
    return 1.0 if sample["output_text"] == item["a"] else 0.0
"""


@pytest.fixture
def secrets(tmp_path: Path) -> Iterator[Path]:
    """A data directory with an API key file and a job directory, as the worker's."""
    data = tmp_path / "data"
    (data / "jobs" / "job-1").mkdir(parents=True)
    (data / "jobs" / "job-1" / "spec.json").write_text("{}")
    (data / "api_key").write_text("sk-secret")
    yield data


def no_sandbox_processes(uid: int = LIMITS.uid) -> bool:
    """No runner (or child of one) of any sandbox is left: they run the grader's file."""
    out = subprocess.run(["ps", "-u", str(uid), "-o", "args="], capture_output=True, text=True,
                         check=False)
    return not [line for line in out.stdout.splitlines() if "/grader/grader.py" in line]


def test_a_good_grader_scores() -> None:
    with PythonSandbox(GOOD, LIMITS) as sb:
        assert sb.call({"output_text": "x"}, {"a": "x"}).score == 1.0
        assert sb.call({"output_text": "y"}, {"a": "x"}).score == 0.0


def test_no_network() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        error, after = run(
            "import socket\ndef grade(s, i):\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    return 1.0\n"
        )
    finally:
        server.close()
    assert error is not None and "Connection refused" in error
    assert after == 1.0


def test_no_job_directory_and_no_api_key_file(secrets: Path) -> None:
    for path in (secrets / "api_key", secrets / "jobs" / "job-1" / "spec.json"):
        error, after = run(f"def grade(s, i):\n    return float(len(open({str(path)!r}).read()))\n")
        assert error is not None and "No such file or directory" in error
        assert after == 1.0


def test_it_sees_nothing_but_its_code_and_the_runtime() -> None:
    error, _ = run("import os\ndef grade(s, i):\n    raise RuntimeError(sorted(os.listdir('/')))\n")
    assert error is not None
    assert "'grader'" in error and "'work'" not in error and "'root'" not in error
    assert "'etc'" not in error and "'home'" not in error


def test_no_secrets_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTUNE_GRADER_JUDGE_API_KEY", "sk-judge")
    error, _ = run("import os\ndef grade(s, i):\n    raise RuntimeError(dict(os.environ))\n")
    assert error is not None and "sk-judge" not in error and "FTUNE" not in error


def test_a_fork_bomb_stops_at_the_process_limit() -> None:
    error, after = run(
        "import os, time\ndef grade(s, i):\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n"
    )
    assert error is not None and "Resource temporarily unavailable" in error
    assert after == 1.0
    assert no_sandbox_processes()


def test_ten_gigabytes_are_refused() -> None:
    error, after = run("def grade(s, i):\n    x = bytearray(10 * 2**30)\n    return 1.0\n")
    assert error is not None and "MemoryError" in error
    assert after == 1.0


def test_a_loop_forever_is_stopped() -> None:
    error, after = run("def grade(s, i):\n    while True:\n        pass\n")
    assert error is not None
    assert "CPU time limit" in error or "wall-clock limit" in error
    assert after == 1.0
    assert no_sandbox_processes()


def test_a_sleeping_grader_hits_the_wall_clock() -> None:
    limits = SandboxLimits(wall_seconds=1.5, cpu_seconds=2)
    error, after = run("import time\ndef grade(s, i):\n    time.sleep(60)\n", limits)
    assert error is not None and "wall-clock limit" in error
    assert after == 1.0


def test_a_large_file_hits_the_file_size_limit() -> None:
    error, after = run(
        "def grade(s, i):\n    open('/tmp/big', 'wb').write(b'x' * (8 << 20))\n    return 1.0\n"
    )
    # Python ignores SIGXFSZ: the write fails with EFBIG instead of the process dying.
    assert error is not None and ("File too large" in error or "file size limit" in error)
    assert after == 1.0


def test_it_runs_as_an_unprivileged_user_that_cannot_write_its_code() -> None:
    error, _ = run(
        "import os\ndef grade(s, i):\n    open('/grader/grader.py', 'a')\n    return 1.0\n"
    )
    assert error is not None and ("Read-only" in error or "Permission denied" in error)
    assert os.geteuid() == 0  # the host process is unchanged
