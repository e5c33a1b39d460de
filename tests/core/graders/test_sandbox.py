"""Python graders in their sandbox: each limit proven by a grader that tries to break it.
Every such grader gets no score and an error saying why; the host is unharmed (no process of
the sandbox is left, the next call of the same grader works).

Each escape runs twice: hosted by this (root) process, and hosted by a process started as an
ordinary user (tests/core/graders/sandbox_host.py), as the Docker image runs the API and the
worker; there the sandbox lives in user namespaces of its own."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from core.graders.sandbox import PythonSandbox, SandboxLimits, sandbox_refusal
from tests.utils.unprivileged import USER, as_user, give, python, user_env

REPO = Path(__file__).resolve().parents[3]
# 13 processes: an odd number, so that the runners of these tests are told apart (by their
# argv) from other sandboxes on the machine.
LIMITS = SandboxLimits(wall_seconds=5, cpu_seconds=2, memory_bytes=512 << 20, processes=13)
GOOD = "def grade(sample, item):\n    return 1.0 if sample['output_text'] == item['a'] else 0.0\n"

# After the attack, the same grader answers normally: the sandbox is restarted if it died.
_SWITCH = """
_attack = grade
def grade(sample, item):
    if sample["output_text"] == "attack":
        return _attack(sample, item)
    return 1.0 if sample["output_text"] == item["a"] else 0.0
"""
ATTACK_THEN_GOOD = [({"output_text": "attack"}, {"a": "x"}), ({"output_text": "x"}, {"a": "x"})]


class Host:
    """Runs graders in sandboxes, from this process ("root") or from a process of an
    ordinary user ("user")."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def calls(self, source: str, calls: list[tuple[dict[str, str], dict[str, str]]],
              limits: SandboxLimits = LIMITS) -> list[tuple[float | None, str | None]]:
        if self.mode == "root":
            with PythonSandbox(source, limits) as sb:
                return [(r.score, r.error) for r in (sb.call(s, i) for s, i in calls)]
        out = subprocess.run(
            as_user([python(), "-m", "tests.core.graders.sandbox_host"]),
            input=json.dumps({"source": source, "limits": asdict(limits), "calls": calls}),
            capture_output=True, text=True, cwd=REPO, env=user_env(), timeout=120, check=True,
        )
        answer = json.loads(out.stdout)
        assert answer["euid"] == USER
        assert "refusal" not in answer, answer["refusal"]
        return [(r["score"], r["error"]) for r in answer["results"]]

    def run(self, source: str, limits: SandboxLimits = LIMITS) -> tuple[str | None, float | None]:
        """(error of a hostile call, score of a good call right after it in the same sandbox)."""
        (bad_score, bad_error), (good, _) = self.calls(source + "\n" + _SWITCH,
                                                       ATTACK_THEN_GOOD, limits)
        assert bad_score is None
        return bad_error, good


@pytest.fixture(params=["root", "user"])
def host(request: pytest.FixtureRequest) -> Host:
    return Host(request.param)


@pytest.fixture
def secrets() -> Iterator[Path]:
    """A data directory with an API key file and a job directory, as the worker's: owned by
    the user, so a user-hosted sandbox would read them if it could see them."""
    data = Path(tempfile.mkdtemp(prefix="ftune-secrets-"))
    (data / "jobs" / "job-1").mkdir(parents=True)
    (data / "jobs" / "job-1" / "spec.json").write_text("{}")
    (data / "api_key").write_text("sk-secret")
    data.chmod(0o755)
    give(data)
    yield data
    subprocess.run(["rm", "-rf", str(data)], check=True)


def no_sandbox_processes(limits: SandboxLimits = LIMITS) -> bool:
    """No runner (or child of one) of these tests' sandboxes is left, whichever user it ran
    as: they run the grader's file with the limits as arguments."""
    out = subprocess.run(["ps", "-e", "-ww", "-o", "args="], capture_output=True, text=True,
                         check=False)
    mark = f"/grader/grader.py {limits.cpu_seconds} {limits.processes}"
    return not [line for line in out.stdout.splitlines() if line.endswith(mark)]


def test_this_machine_runs_the_sandbox() -> None:
    assert sandbox_refusal() is None  # `make sandbox` installs bubblewrap


def test_a_good_grader_scores(host: Host) -> None:
    calls = [({"output_text": "x"}, {"a": "x"}), ({"output_text": "y"}, {"a": "x"})]
    assert host.calls(GOOD, calls) == [(1.0, None), (0.0, None)]


def test_a_closed_sandbox_leaves_no_process() -> None:
    with PythonSandbox(GOOD, LIMITS) as sb:
        assert sb.call({"output_text": "x"}, {"a": "x"}).score == 1.0
        assert not no_sandbox_processes()  # the check sees a live runner
    assert no_sandbox_processes()


def test_no_network(host: Host) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        error, after = host.run(
            "import socket\ndef grade(s, i):\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    return 1.0\n"
        )
    finally:
        server.close()
    assert error is not None and "Connection refused" in error
    assert after == 1.0


def test_no_job_directory_and_no_api_key_file(host: Host, secrets: Path) -> None:
    for path in (secrets / "api_key", secrets / "jobs" / "job-1" / "spec.json"):
        error, after = host.run(
            f"def grade(s, i):\n    return float(len(open({str(path)!r}).read()))\n")
        assert error is not None and "No such file or directory" in error
        assert after == 1.0


def test_it_sees_nothing_but_its_code_and_the_runtime(host: Host) -> None:
    error, _ = host.run("import os\ndef grade(s, i):\n    raise RuntimeError(sorted(os.listdir('/')))\n")
    assert error is not None
    assert "'grader'" in error and "'work'" not in error and "'root'" not in error
    assert "'etc'" not in error and "'home'" not in error


def test_no_secrets_in_the_environment(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTUNE_GRADER_JUDGE_API_KEY", "sk-judge")
    error, _ = host.run("import os\ndef grade(s, i):\n    raise RuntimeError(dict(os.environ))\n")
    assert error is not None and "sk-judge" not in error and "FTUNE" not in error


def test_a_fork_bomb_stops_at_the_process_limit(host: Host) -> None:
    error, after = host.run(
        "import os, time\ndef grade(s, i):\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n"
    )
    assert error is not None and "Resource temporarily unavailable" in error
    assert after == 1.0
    assert no_sandbox_processes()


def test_ten_gigabytes_are_refused(host: Host) -> None:
    error, after = host.run("def grade(s, i):\n    x = bytearray(10 * 2**30)\n    return 1.0\n")
    assert error is not None and "MemoryError" in error
    assert after == 1.0


def test_a_loop_forever_is_stopped(host: Host) -> None:
    error, after = host.run("def grade(s, i):\n    while True:\n        pass\n")
    assert error is not None
    assert "CPU time limit" in error or "wall-clock limit" in error
    assert after == 1.0
    assert no_sandbox_processes()


def test_a_sleeping_grader_hits_the_wall_clock(host: Host) -> None:
    limits = SandboxLimits(wall_seconds=1.5, cpu_seconds=2, processes=LIMITS.processes)
    error, after = host.run("import time\ndef grade(s, i):\n    time.sleep(60)\n", limits)
    assert error is not None and "wall-clock limit" in error
    assert after == 1.0
    assert no_sandbox_processes(limits)


def test_a_large_file_hits_the_file_size_limit(host: Host) -> None:
    error, after = host.run(
        "def grade(s, i):\n    open('/tmp/big', 'wb').write(b'x' * (8 << 20))\n    return 1.0\n"
    )
    # Python ignores SIGXFSZ: the write fails with EFBIG instead of the process dying.
    assert error is not None and ("File too large" in error or "file size limit" in error)
    assert after == 1.0


def test_it_runs_as_an_unprivileged_user_that_cannot_write_its_code(host: Host) -> None:
    error, _ = host.run(
        "import os\ndef grade(s, i):\n    open('/grader/grader.py', 'a')\n    return 1.0\n"
    )
    assert error is not None and ("Read-only" in error or "Permission denied" in error)
    error, _ = host.run("import os\ndef grade(s, i):\n    raise RuntimeError(os.getuid())\n")
    assert error == f"RuntimeError: {LIMITS.uid}"


def test_it_may_not_make_namespaces_of_its_own(host: Host) -> None:
    # A namespace of its own would give the grader capabilities there (mounts, raw sockets):
    # more kernel to attack. unshare(CLONE_NEWUSER) through libc, no tool needed.
    error, _ = host.run(
        "import ctypes, os\ndef grade(s, i):\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    if libc.unshare(0x10000000) != 0:\n"
        "        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n"
        "    return 1.0\n"
    )
    assert error is not None and error.startswith("OSError")


def test_without_bubblewrap_the_refusal_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PATH with every tool but bwrap, as on a host where `make sandbox` never ran.
    for tool in ("prlimit", "setpriv"):
        (tmp_path / tool).symlink_to(f"/usr/bin/{tool}")
    monkeypatch.setenv("PATH", str(tmp_path))
    refusal = sandbox_refusal()
    assert refusal is not None
    assert "bwrap" in refusal and "apt-get install bubblewrap" in refusal


def test_without_user_namespaces_the_refusal_says_so() -> None:
    # An ordinary user in a user namespace that may have no child namespace (its limit is 1
    # and the user's own namespace used it): bwrap cannot start, as under a kernel or a
    # container profile that forbids user namespaces.
    script = ("from core.graders.sandbox import sandbox_refusal\n"
              "print(sandbox_refusal())\n")
    argv = as_user(["unshare", "--user", "--map-root-user", "sh", "-c",
                    'echo 1 > /proc/sys/user/max_user_namespaces && exec unshare --user "$@"',
                    "sh", python(), "-c", script])
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=user_env(),
                         timeout=60, check=True)
    assert "the sandbox did not start" in out.stdout
    assert "user namespaces" in out.stdout and "max_user_namespaces" in out.stdout
