"""`ftune` commands that run the service, for the operator: migrate, create-key, api,
worker, webhooks, retention, up, doctor, deployments."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from cli.common import KeyOpt, UrlOpt, console, fail, out

commands = typer.Typer()  # the commands that run the service; cli/main.py adds them to `ftune`
# `ftune deployments [stop ID]`: cli/main.py adds it as a group of its own.
deployments = typer.Typer(help="The engine servers (admin key): list them, stop one.")


@commands.command()
def migrate() -> None:
    """Bring the database schema to the latest migration."""
    from core.db.migrate import upgrade_head
    from core.infra.settings import get_settings

    settings = get_settings()
    if settings.is_sqlite:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    assert settings.database_url is not None
    upgrade_head(settings.database_url)


@commands.command("create-key")
def create_key(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to (made if new).")],
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
    admin: Annotated[
        bool, typer.Option(help="An admin key: also sees and drains the workers (/v1/workers).")
    ] = False,
) -> None:
    """Create an API key. It is printed once; only its hash is stored."""
    from api.services.keys import create_api_key
    from core.db.session import session_scope

    with session_scope() as session:
        key = create_api_key(session, tenant, name, role="admin" if admin else "tenant")
    out.print(key)


@commands.command()
def api(
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: Annotated[int, typer.Option(
        min=1, envvar="FTUNE_API_WORKERS",
        help="API processes (uvicorn workers). One process served 800-2,000 job reads a "
        "second on one core of a small VM (docs/benchmarks.md); give a busy dashboard one "
        "per core.")] = 1,
) -> None:
    """Run the API server (uvicorn)."""
    from cli.embedded import api_argv

    os.execv(sys.executable, api_argv(host, port, workers))


@commands.command()
def worker(
    name: Annotated[str, typer.Option(help="Celery node name.")] = "ftune@%h",
) -> None:
    """Run the worker of this node: one job per free GPU set at once (see docs/fleet.md)."""
    from cli.embedded import worker_argv
    from core.infra.settings import get_settings

    os.execv(sys.executable, worker_argv(get_settings().queue_name, name))


@commands.command()
def webhooks() -> None:
    """Run the webhook sender on its own (workers also send unless
    FTUNE_WEBHOOK_SENDER_IN_WORKER=false). Stops on SIGTERM or Ctrl-C."""
    import threading

    from core.db.session import get_sessionmaker
    from core.infra.logging import configure_logging
    from core.infra.settings import get_settings
    from worker.upkeep.webhook_sender import Sender

    settings = get_settings()
    configure_logging(settings.log_level, json=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sender = Sender(get_sessionmaker(), settings)
    try:
        sender.run(stop)
    finally:
        sender.close()


@commands.command()
def retention(
    max_jobs: Annotated[int | None, typer.Option(help="Stop after this many jobs a kind.")] = None,
) -> None:
    """Apply the retention settings once (FTUNE_RETENTION_*_DAYS; workers also apply them
    every FTUNE_RETENTION_INTERVAL_SECONDS): deletes old finished jobs' events, logs and
    artifacts in small transactions. See docs/operations-retention.md."""
    from core.db.models import utcnow
    from core.db.session import get_sessionmaker
    from core.infra.settings import get_settings
    from worker.upkeep.retention import apply_retention, cutoffs

    settings = get_settings()
    if not cutoffs(settings, utcnow()):
        out.print("no retention is set (FTUNE_RETENTION_EVENTS_DAYS, _LOGS_DAYS, _ARTIFACTS_DAYS)")
        return
    for kind, jobs in apply_retention(get_sessionmaker(), settings, max_jobs=max_jobs).items():
        out.print(f"{kind}: {jobs} finished job(s) read")


@commands.command()
def up(
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: Annotated[Path | None, typer.Option(envvar="FTUNE_DATA_DIR")] = None,
) -> None:
    """Embedded mode: API + one worker on this machine, SQLite and a server-less broker."""
    from cli.connect import forget_url, remember_url
    from cli.embedded import EMBEDDED_WORKER_NICE, EmbeddedStack

    stack = EmbeddedStack(data_dir=data_dir or Path(".ftune"), host=host, port=port,
                          worker_nice=EMBEDDED_WORKER_NICE)  # fmt: skip
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as e:
        stack.stop()
        fail(e)
    console.print(f"ftune is up at [bold]{stack.url}[/bold]  (data: {stack.data_dir})")
    console.print(f"API key: {stack.api_key}   (also in {stack.data_dir / 'api_key'}; the CLI "
                  "run from this directory uses both)")
    for line in stack.describe():
        console.print(line, markup=False)
    remember_url(stack.data_dir, stack.url)  # last: once it is there, all of the above was said
    stopping = False

    def _stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping and all(p.poll() is None for p in stack.procs):
            time.sleep(0.5)
    finally:
        console.print("stopping...")
        forget_url(stack.data_dir, stack.url)
        stack.stop()


@commands.command()
def doctor(url: UrlOpt = None) -> None:
    """One screen: what the operator set, which model and data paths are allowed, whether
    the hub, database, broker and API are reachable, GPUs/CPUs seen; each problem with its
    fix. Exit status 1 if any check failed."""
    from cli.connect import resolve_url
    from cli.doctor import operator_settings, run_checks
    from core.infra.settings import get_settings

    try:
        settings = get_settings()
    except ValueError as e:
        fail(ValueError(f"the settings are invalid: {e}"))
    table = Table("setting", "value", title="what the operator set (environment)")
    for name, value in operator_settings() or [("(none)", "every default applies")]:
        table.add_row(name, escape(value))
    out.print(table)
    checks = run_checks(settings, resolve_url(url))
    # One line a check (and one for its fix): whole, whatever the terminal's width.
    for c in checks:
        mark = "[green]ok     [/green]" if c.ok else "[red]PROBLEM[/red]"
        out.print(f"{mark} {escape(c.name)}: {escape(c.detail)}")
        if c.fix:
            out.print(f"        {'fix' if not c.ok else 'note'}: {escape(c.fix)}")
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@deployments.callback(invoke_without_command=True)
def list_deployments(ctx: typer.Context, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """List the deployments: model, state, worker and GPUs, and why a requested one waits."""
    if ctx.invoked_subcommand is not None:
        return
    from cli.connect import connect

    with connect(url, api_key) as c:
        rows = c.list_deployments()
    table = Table("id", "kind", "state", "worker", "gpus", "memory MiB", "last used", "model",
                  "waiting / error")
    for d in rows:
        table.add_row(d["id"], d["kind"], d["state"], escape(d["worker_id"] or "-"),
                      ",".join(str(g) for g in d["gpus"]) or "-", str(d["memory_mb"]),
                      d["last_used_at"][:19], escape(d["model"]),
                      escape(d["waiting"] or d["error"] or ""))
    out.print(table)


@deployments.command("stop")
def stop_deployment(deployment_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Stop a deployment now: its worker stops the engine's process tree and frees its GPUs;
    the next request for its model starts it again."""
    from cli.connect import connect

    with connect(url, api_key) as c:
        d = c.stop_deployment(deployment_id)
    out.print(f"{d['id']} {d['state']}")
