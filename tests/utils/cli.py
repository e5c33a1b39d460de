"""The `ftune` command as a user runs it: a real process, in a directory of the user's own,
with the environment a user's shell has (none of the suite's service settings). The `up`
fixture that starts `ftune up` for a module is in tests/cli/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

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
