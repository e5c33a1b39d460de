"""The `ftune` command as a user runs it: a real process, in a directory of the user's own,
against a real `ftune up` (API + worker) started from that directory."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from core.infra.ports import free_port
from testkit.wait import wait_until
from tests.utils.cli import FTUNE, UNREACHABLE_HUB, Up, user_env


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
    try:
        wait_until(url_file.exists, 240, "ftune up to write its URL", every=0.3,
                   give_up=lambda: proc.poll() is not None and "it exited")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{output.read_text()[-3000:]}") from None
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
