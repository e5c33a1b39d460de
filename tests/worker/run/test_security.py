"""What the worker must never do: run a shell, hand credentials to the trainer (or to a
model repo's own code), print a password, or trust remote code the operator did not allow."""

from __future__ import annotations

import ast
import json
import logging
import os
from pathlib import Path

import pytest

from core.db.models import JobStatus
from core.run.jobdir import JobDir
from testkit.launch import REPO_ROOT
from tests.utils.worker import WorkerEnv, events_of, fake_job, get_job, set_job
from worker.run import process_tree
from worker.run.local import run_job

SKIP_DIRS = {".venv", "venv", ".git", "node_modules", "build", "dist", "__pycache__", ".ftune"}


def _python_files() -> list[Path]:
    out = []
    for root, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        out += [Path(root) / f for f in files if f.endswith(".py")]
    return out


def _shell_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """shell=True in any call; os.system / os.popen / subprocess.getoutput-style calls."""
    found = []
    banned = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"),
              ("subprocess", "getstatusoutput"), ("os", "execl"), ("os", "spawnl")}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                          and kw.value.value is False):
                found.append((node.lineno, "shell=" + ast.unparse(kw.value)))
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
                (f.value.id, f.attr) in banned:
            found.append((node.lineno, f"{f.value.id}.{f.attr}()"))
    return found


def test_no_shell_strings_anywhere_in_the_repo() -> None:
    files = _python_files()
    assert len(files) > 50, "the scan must see the repository's code"
    offenders = []
    for path in files:
        source = path.read_text(errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            offenders.append(f"{path}: does not parse")
            continue
        offenders += [f"{path.relative_to(REPO_ROOT)}:{line}: {what}"
                      for line, what in _shell_calls(tree)]
        # Imports under another name (from os import system) get the same answer.
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                    {a.name for a in node.names} & {"system", "popen"}:
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: from os import")
    assert offenders == []


def test_the_scan_finds_what_it_looks_for() -> None:
    bad = ast.parse("import os, subprocess\nsubprocess.run('ls', shell=True)\nos.system('x')\n"
                    "os.popen('y')\nsubprocess.call(['a'], shell=flag)\n")
    assert [w for _, w in _shell_calls(bad)] == ["shell=True", "os.system()", "os.popen()",
                                                 "shell=flag"]


def test_trainer_env_carries_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    from core.infra.settings import reset_settings_cache

    reset_settings_cache()
    base = {
        "DATABASE_URL": "postgresql+psycopg://ftune:db-s3cret-pw@db:5432/ftune",
        "BROKER_URL": "redis://:redis-s3cret-pw@redis:6379/0",
        "FTUNE_BOOTSTRAP_API_KEY": "ft_bootstrap_key_0123456789",
        "CELERY_BROKER_URL": "redis://:redis-s3cret-pw@redis:6379/0",  # a copy, other name
        "MY_APP_DSN": "postgresql://ftune:db-s3cret-pw@db/ftune",
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin",
    }
    env = process_tree.trainer_env(base)
    text = "\n".join(f"{k}={v}" for k, v in env.items())
    for secret in ("db-s3cret-pw", "redis-s3cret-pw", "ft_bootstrap_key_0123456789"):
        assert secret not in text
    assert env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/usr/bin"
    assert float(env["FTUNE_ORPHAN_GRACE_SECONDS"]) > 0


def test_urls_are_logged_without_their_password() -> None:
    from worker.queue.celery_app import redact_url

    assert redact_url("postgresql+psycopg://u:pw@h:5432/d") == "postgresql+psycopg://u:***@h:5432/d"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("sqlite:////data/ftune.db") == "sqlite:////data/ftune.db"
    assert redact_url("filesystem://") == "filesystem://"


def _remote_code_job(w: WorkerEnv) -> str:
    job_id = fake_job(w, "succeed")
    spec = dict(get_job(job_id).spec)
    spec["model"] = {**spec["model"], "trust_remote_code": True}
    set_job(job_id, spec=spec)
    return job_id


def test_trust_remote_code_is_refused_unless_the_operator_allows_it(
        wenv: WorkerEnv, direct: None, monkeypatch: pytest.MonkeyPatch) -> None:
    refused = _remote_code_job(wenv)
    assert run_job(refused) == JobStatus.failed
    job = get_job(refused)
    assert job.error_code == "invalid_spec"
    assert "trust_remote_code" in (job.error_message or "")
    assert not (wenv.settings.jobs_dir / refused / "trainer.log").exists()

    monkeypatch.setenv("FTUNE_ALLOW_TRUST_REMOTE_CODE", "true")
    wenv.reload()
    allowed = _remote_code_job(wenv)
    assert run_job(allowed) == JobStatus.succeeded
    assert JobDir(wenv.settings.jobs_dir / allowed).read_spec()["runtime"][
        "allow_trust_remote_code"] is True


def test_a_job_run_logs_no_credential(wenv: WorkerEnv, direct: None,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    job_id = fake_job(wenv, "env")
    assert run_job(job_id) == JobStatus.succeeded
    env = json.loads((wenv.settings.jobs_dir / job_id / "env.json").read_text())
    assert not {"DATABASE_URL", "BROKER_URL", "FTUNE_BOOTSTRAP_API_KEY"} & set(env)
    db_url = str(wenv.settings.database_url)
    assert db_url not in caplog.text
    assert [e for e in events_of(job_id) if db_url in (e.message or "")] == []
