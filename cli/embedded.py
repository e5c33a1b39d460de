"""The embedded stack: API + one worker as child processes, SQLite and a server-less broker.

Same code paths as production (uvicorn serving api.main:app, a Celery worker consuming the
queue); only the URLs differ. `ftune up`, `ftune demo` and the end-to-end tests use it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from core.infra.ports import free_port

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The worker's nice value under `ftune up` and `ftune demo` (core/infra/settings.py worker_nice):
# its weight is then ~1/9 of the API's (nice 0), so the API's loop is served first whenever
# it is runnable. The price: on a machine busy with other work, training yields to that too
# (bench/api_latency.py, 2026-11-26: at load 12 on 2 cores a trainer at nice 10 got ~3% of
# the CPU). Tests and benches that build a stack keep 0 unless they ask.
EMBEDDED_WORKER_NICE = 10


def load_or_create_api_key(data_dir: Path) -> str:
    """The embedded setup's key: kept in <data_dir>/api_key (mode 0600), made once."""
    path = data_dir / "api_key"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    key = "ft_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def worker_argv(queue: str, name: str) -> list[str]:
    # One pool thread per slot (worker.queue.celery_app sets the concurrency from the worker's
    # inventory: one per GPU, or the CPU slots the operator set), no prefetch: each thread
    # runs one job at a time on the GPUs the scheduler gave it.
    return [
        # --quiet: no ASCII-art banner in the log, whose lines are JSON (celery_app.py).
        sys.executable, "-m", "celery", "--quiet", "-A", "worker.queue.celery_app", "worker",
        "--pool=threads", "--prefetch-multiplier=1",
        "-Q", queue, "-n", name, "--loglevel=INFO", "-E",
    ]  # fmt: skip


def api_argv(host: str, port: int, workers: int = 1, loop: str = "asyncio") -> list[str]:
    # Several processes share the port (uvicorn's workers); each keeps its own caches (keys,
    # queue snapshot), whose bounds are per process.
    # asyncio's own event loop, not uvloop (uvicorn's "auto" choice when it is installed):
    # libuv accepts one connection per turn of its loop (libuv PR 3696), so under load a
    # burst of new connections waits one turn each (tens of ms each), the last for seconds:
    # GET job p99 0.9-1.4 s at 100 connections against 128-150 ms with asyncio's loop,
    # which accepts every pending connection at once, for 0-14 % more CPU per request
    # (docs/benchmarks-history.md, "New connections under load"). ``loop``: for the bench's
    # comparison (bench/api_latency.py --loop).
    return [
        sys.executable, "-m", "uvicorn", "api.main:app",
        "--host", host, "--port", str(port), "--log-level", "warning", "--loop", loop,
        *(["--workers", str(workers)] if workers > 1 else []),
    ]  # fmt: skip


@dataclass
class EmbeddedStack:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    env_overrides: dict[str, str] = field(default_factory=dict)
    workers: int = 1
    worker_nice: int = 0  # EMBEDDED_WORKER_NICE for `ftune up`; FTUNE_WORKER_NICE wins
    log_dir: Path | None = None
    api_key: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("DATABASE_URL", f"sqlite:///{self.data_dir / 'ftune.db'}")
        env.setdefault("BROKER_URL", "filesystem://")
        if self.host in LOOPBACK:
            # One machine whose user is its operator: a model or dataset directory anywhere
            # on it is accepted. Served beyond this machine, paths are refused unless the
            # operator sets the roots (the refusal names them).
            env.setdefault("FTUNE_ALLOWED_MODEL_ROOTS", "/")
            env.setdefault("FTUNE_ALLOWED_DATA_ROOTS", "/")
        if self.worker_nice:
            # The API and the worker share this machine's CPUs: the worker and every trainer
            # it starts run at a lower priority, so that a trainer keeping every core busy
            # yields them to the API's event loop. The operator's setting wins.
            env.setdefault("FTUNE_WORKER_NICE", str(self.worker_nice))
        env.update(self.env_overrides)
        env["FTUNE_DATA_DIR"] = str(self.data_dir)
        env["FTUNE_BOOTSTRAP_API_KEY"] = self.api_key
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    @property
    def logs_dir(self) -> Path:
        return self.log_dir or self.data_dir / "logs"

    def describe(self) -> list[str]:
        """What a user of `ftune up` needs to know about this stack, one line each."""
        env = self.env()

        def roots(var: str) -> str:
            value = env.get(var, "")
            if value == "/":
                return f"any local directory (set {var} to restrict)"
            return value.replace(":", ", ") if value else f"none: paths are refused (set {var})"

        return [
            f"model directories: {roots('FTUNE_ALLOWED_MODEL_ROOTS')}",
            f"dataset paths: {roots('FTUNE_ALLOWED_DATA_ROOTS')}",
            (f"logs (JSON lines): {self.logs_dir}/api.log, worker*.log; each job's trainer "
             f"log in {self.data_dir / 'jobs'}/<job id>/trainer.log"),
        ]

    def start(self, timeout: float = 120.0) -> Self:
        self.data_dir = self.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.api_key:
            self.api_key = load_or_create_api_key(self.data_dir)
        if not self.port:
            self.port = free_port()
        env = self.env()
        log_dir = self.logs_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        # Schema first, in its own process, so the API and worker start on a migrated DB.
        subprocess.run([sys.executable, "-m", "cli.main", "migrate"], env=env, check=True)
        queue = env.get("FTUNE_QUEUE_NAME", "ftune.jobs")
        self._spawn(api_argv(self.host, self.port), env, log_dir / "api.log")
        for i in range(self.workers):
            name = f"worker{i}-{secrets.token_hex(3)}@%h"
            self._spawn(worker_argv(queue, name), env, log_dir / f"worker{i}.log")
        self.wait_ready(timeout)
        return self

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        # Own session: Ctrl-C in a terminal reaches ftune, which stops children in order.
        with open(log, "ab") as out:
            self.procs.append(
                subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            )  # fmt: skip

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    argv = p.args if isinstance(p.args, list) else [p.args]
                    raise RuntimeError(
                        f"{' '.join(map(str, argv[:6]))} exited with {p.returncode}; "
                        f"see logs in {self.log_dir or self.data_dir / 'logs'}"
                    )
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as e:
                last = str(e)
            time.sleep(0.3)
        raise TimeoutError(f"the API was not ready after {timeout} s: {last}")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM every child (the worker hands its running job back), then SIGKILL."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
