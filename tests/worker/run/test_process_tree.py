"""Killing a trainer's whole process tree, with real processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil

from core.infra.ports import free_port
from testkit.wait import wait_until
from worker.run import process_tree

# Every process ignores SIGTERM, so only the SIGKILL phase can end them.
SCRIPT = r'''
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
out, role = sys.argv[1], sys.argv[2]
def spawn(r, **kw):
    return subprocess.Popen([sys.executable, __file__, out, r], **kw)
def note(name, pid):
    with open(os.path.join(out, name), "w") as f:
        f.write(str(pid))
if role == "root":
    spawn("level1")
    spawn("escaper")
elif role == "level1":
    spawn("level2")
elif role == "level2":
    spawn("level3")
elif role == "escaper":
    # A new session, then a double fork: the survivor is re-parented away from the tree.
    os.setsid()
    if os.fork() == 0:
        note("escaped", os.getpid())
        while True: time.sleep(1)
    os._exit(0)
note(role, os.getpid())
while True:
    time.sleep(1)
'''


def _wait_for(folder: Path, names: list[str], timeout: float = 20) -> dict[str, int]:
    wait_until(lambda: all((folder / n).exists() and (folder / n).read_text() for n in names),
               timeout, f"the tree to start (pid files {names})", every=0.05)
    return {n: int((folder / n).read_text()) for n in names}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_tree_kills_every_level_and_a_setsid_escapee(tmp_path: Path) -> None:
    script = tmp_path / "tree.py"
    script.write_text(SCRIPT)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    launched = process_tree.spawn([sys.executable, str(script), str(pids_dir), "root"],
                              log_path=tmp_path / "log.txt", env=process_tree.trainer_env(),
                              tag=process_tree.new_tag("job-test", 1))
    pids = _wait_for(pids_dir, ["root", "level1", "level2", "level3", "escaped"])
    escaped = psutil.Process(pids["escaped"])
    assert escaped.ppid() != pids["root"] and process_tree.os.getsid(escaped.pid) != launched.pid
    launched.track()

    survivors = process_tree.stop_tree(launched, grace=0.5, stop_file=tmp_path / "STOP")

    assert survivors == set()
    assert (tmp_path / "STOP").exists()
    assert launched.poll() is not None
    for role, pid in pids.items():
        assert _gone(pid), f"{role} ({pid}) survived"
    assert process_tree.tagged_prefix("job-test:") == set()


def test_trainer_env_drops_secrets_and_sets_unbuffered() -> None:
    env = process_tree.trainer_env({"DATABASE_URL": "postgresql://x", "HF_HUB_OFFLINE": "1",
                                "FTUNE_BOOTSTRAP_API_KEY": "k" * 20, "PATH": "/bin"},
                               extra={"ACCELERATE_USE_CPU": "true"})
    assert "DATABASE_URL" not in env and "FTUNE_BOOTSTRAP_API_KEY" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["ACCELERATE_USE_CPU"] == "true"
    assert json.dumps(env)  # plain strings only


def test_free_ports_differ_per_job() -> None:
    ports = {free_port() for _ in range(5)}
    assert len(ports) >= 4 and all(1024 < p < 65536 for p in ports)
