"""The `ftune` command as a user runs it: a real process, in a directory of the user's own,
against a real `ftune up` (API + worker) started from that directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from core.infra.ports import free_port

FTUNE = Path(sys.executable).with_name("ftune")
# Never resolves (RFC 6761): a hub this machine cannot reach, whatever its network.
UNREACHABLE_HUB = "http://hub.invalid"
# What a user's shell would not have: the suite's own settings of the service.
_NOT_THE_USERS = ("FTUNE_URL", "FTUNE_API_KEY", "FTUNE_DATA_DIR", "DATABASE_URL", "BROKER_URL",
                  "FTUNE_BOOTSTRAP_API_KEY", "FTUNE_ALLOWED_MODEL_ROOTS",
                  "FTUNE_ALLOWED_DATA_ROOTS")


def user_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _NOT_THE_USERS}
    return {**env, **extra}


def ftune(*args: str, cwd: Path, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The installed `ftune` command, its output captured (so: piped, not a terminal)."""
    return subprocess.run([str(FTUNE), *args], check=False, cwd=cwd, env=env or user_env(),
                          capture_output=True, text=True, timeout=timeout)


def assert_no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]


@dataclass
class Up:
    home: Path  # the user's directory, where `ftune up` runs and the CLI is run from
    url: str
    key: str
    env: dict[str, str]
    output: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return ftune(*args, cwd=self.home, env={**self.env, **env})

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"},
                            timeout=30)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`ftune up` as the README says, on a free port, with a hub this machine cannot reach
    and the hub check on (the suite turns it off elsewhere)."""
    home = tmp_path_factory.mktemp("user")
    env = user_env(FTUNE_HUB_CHECK="true", HF_ENDPOINT=UNREACHABLE_HUB, HF_HUB_OFFLINE="0",
                   HF_HUB_CACHE=str(home / "hub-cache"))
    port = free_port()
    output = home / "up.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen([str(FTUNE), "up", "--port", str(port)], cwd=home, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url_file = home / ".ftune" / "url"
    deadline = time.monotonic() + 240
    while not url_file.exists():
        assert proc.poll() is None, output.read_text()[-3000:]
        assert time.monotonic() < deadline, output.read_text()[-3000:]
        time.sleep(0.3)
    key = (home / ".ftune" / "api_key").read_text().strip()
    try:
        yield Up(home, url_file.read_text().strip(), key, env, output, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
