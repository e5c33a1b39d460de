"""Real processes to break on purpose: a redis-server of our own, a PostgreSQL database of our
own, and the embedded stack (cli/embedded.py) whose API and workers can each be SIGKILLed
and started again. Used by tests/e2e/faults/ and bench/faults.py; loopback only.

Never touch the shared Redis on 6379: other tests use it. Every RedisServer here runs on a
free port, without persistence (no RDB, no AOF), so a restart loses every message, which is
the fault under test.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from cli.embedded import EmbeddedStack, api_argv, worker_argv
from core.infra.ports import free_port
from testkit.pg import PG_ADMIN_URL, create_database, drop_database

REPO_ROOT = Path(__file__).resolve().parents[1]

# What a stack's worker needs from the parent environment; everything FTUNE_* is set here.
_DROP_ENV = ("FTUNE_WORKER_ID", "FTUNE_TRAINER_FAULT", "DATABASE_URL", "BROKER_URL")


# ------------------------------------------------------------------------------- Redis


@dataclass
class RedisServer:
    """redis-server on a free loopback port, with a password, no persistence."""

    dir: Path
    password: str = field(default_factory=lambda: "rpw-" + secrets.token_hex(8))
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "redis.conf"
        # In a file (mode 0600), not on the command line: `ps` shows argv to everyone.
        conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", "protected-mode yes", 'save ""',
            "appendonly no", f"dir {self.dir}", f"requirepass {self.password}",
            "daemonize no", "loglevel warning", f"logfile {self.dir / 'redis.log'}",
        ]) + "\n")
        conf.chmod(0o600)
        self.proc = subprocess.Popen([exe, str(conf)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self.log_tail()}") from None
            time.sleep(0.05)

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: a crash. With no persistence, every queued message is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def flushall(self) -> None:
        self.client().flushall()

    def log_tail(self) -> str:
        p = self.dir / "redis.log"
        return p.read_text(errors="replace")[-2000:] if p.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


# -------------------------------------------------------------------------- PostgreSQL


@dataclass
class PgDatabase:
    """A fresh PostgreSQL database (dropped by ``drop``). Its URL carries a password the
    local server does not need (trust auth), so tests can check it never reaches a log."""

    name: str = field(default_factory=lambda: f"ftune_faults_{secrets.token_hex(4)}")
    password: str = field(default_factory=lambda: "pgpw-" + secrets.token_hex(8))

    @property
    def url(self) -> str:
        from sqlalchemy.engine import make_url

        return make_url(PG_ADMIN_URL).set(database=self.name, password=self.password) \
            .render_as_string(hide_password=False)

    def create(self) -> PgDatabase:
        create_database(self.name)
        return self

    def drop(self) -> None:
        drop_database(self.name)


# ------------------------------------------------------------------------------ stack


def fast_worker_argv(queue: str, name: str) -> list[str]:
    # No gossip/mingle/heartbeat between workers: they add start-up time and nothing here
    # depends on them (the DB coordinates workers).
    return [*worker_argv(queue, name), "--without-gossip", "--without-mingle",
            "--without-heartbeat"]


@dataclass
class FaultStack(EmbeddedStack):
    """The embedded stack with handles on each process: ``workers[i]`` can be SIGKILLed and
    started again under the same name (and a new pid), the API killed and restarted on the
    same port."""

    worker_procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    api_proc: subprocess.Popen[bytes] | None = None
    worker_names: list[str] = field(default_factory=list)
    _ready_marks: dict[int, int] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env.update(self.env_overrides)
        env["FTUNE_DATA_DIR"] = str(self.data_dir)
        env["FTUNE_BOOTSTRAP_API_KEY"] = self.api_key
        env["PYTHONUNBUFFERED"] = "1"
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
        return env

    @property
    def logs(self) -> Path:
        return self.log_dir or self.data_dir / "logs"

    @property
    def queue(self) -> str:
        return self.env().get("FTUNE_QUEUE_NAME", "ftune.jobs")

    def start(self, timeout: float = 120.0) -> FaultStack:
        self.data_dir = self.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.api_key:
            self.api_key = "ft_faults_" + secrets.token_hex(16)
        if not self.port:
            self.port = free_port()
        self.logs.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "cli.main", "migrate"], env=self.env(),
                       cwd=REPO_ROOT, check=True)
        self.start_api(wait=False)
        self.worker_names = [f"w{i}-{secrets.token_hex(3)}@%h" for i in range(self.workers)]
        self.worker_procs = [None] * self.workers
        for i in range(self.workers):
            self.start_worker(i, wait=False)
        self.wait_ready(timeout)
        for i in range(self.workers):
            self.wait_worker(i, timeout)
        return self

    def _popen(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            p = subprocess.Popen(argv, env=self.env(), cwd=REPO_ROOT, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    # -- API

    def start_api(self, *, wait: bool = True, timeout: float = 60.0) -> None:
        self.api_proc = self._popen(api_argv(self.host, self.port), self.logs / "api.log")
        if wait:
            self.wait_ready(timeout)

    def kill_api(self) -> None:
        if self.api_proc is not None:
            self._kill(self.api_proc)

    # -- workers

    def worker_log(self, i: int) -> Path:
        return self.logs / f"worker{i}.log"

    def start_worker(self, i: int, *, wait: bool = True, timeout: float = 60.0) -> None:
        log = self.worker_log(i)
        self._ready_marks[i] = log.stat().st_size if log.exists() else 0
        self.worker_procs[i] = self._popen(fast_worker_argv(self.queue, self.worker_names[i]),
                                           log)
        if wait:
            self.wait_worker(i, timeout)

    def wait_worker(self, i: int, timeout: float = 60.0) -> None:
        """Until worker ``i`` logged " ready." after its latest start."""
        proc, log = self.worker_procs[i], self.worker_log(i)
        assert proc is not None
        mark = self._ready_marks.get(i, 0)
        deadline = time.monotonic() + timeout
        while True:
            text = log.read_bytes()[mark:].decode(errors="replace") if log.exists() else ""
            if " ready." in text:
                return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {i} did not start:\n{text[-3000:]}")
            time.sleep(0.1)

    def worker_pid(self, i: int) -> int | None:
        p = self.worker_procs[i]
        return p.pid if p is not None and p.poll() is None else None

    def worker_index(self, worker_id: str) -> int:
        """Which worker holds a job, from its worker_id (``host:pid``)."""
        pid = int(worker_id.rsplit(":", 1)[1])
        for i, p in enumerate(self.worker_procs):
            if p is not None and p.pid == pid:
                return i
        raise LookupError(f"no worker of this stack has pid {pid}")

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` (only the worker: what it started is left to fend for itself)."""
        p = self.worker_procs[i]
        if p is not None:
            self._kill(p)

    def _kill(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if p in self.procs:  # wait_ready() takes any exited child for a failed start
            self.procs.remove(p)

    def alive_workers(self) -> list[int]:
        return [i for i, p in enumerate(self.worker_procs) if p is not None and p.poll() is None]

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.logs.glob("*.log")))

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)


# ------------------------------------------------------------------------- processes


def launch_processes(job_id: str, attempt: int | None = None) -> set[psutil.Process]:
    """The live processes of a job's launches (launcher, ranks, their children), found by
    the FTUNE_LAUNCH_TAG every one of them inherits."""
    from worker.run import process_tree

    prefix = f"{job_id}:" if attempt is None else f"{job_id}:{attempt}:"
    return process_tree.tagged_prefix(prefix)


def send_run_job(broker_url: str, job_id: str, times: int, *, queue: str) -> None:
    """Deliver "run job X" ``times`` more times on ``queue``, as a broker retry or a
    duplicate publish would."""
    from celery import Celery

    app = Celery("dup", broker=broker_url)
    try:
        for _ in range(times):
            app.send_task("ftune.run_job", args=[job_id], queue=queue)
    finally:
        app.close()


def sigkill(procs: Iterable[psutil.Process]) -> int:
    n = 0
    for p in procs:
        try:
            p.kill()
            n += 1
        except psutil.Error:
            pass
    return n


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
