"""The `ftune` command: run the service (up, api, worker, migrate, create-key) and use it
(submit, status, list, logs, cancel, download, demo)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)
out = Console()

UrlOpt = Annotated[str, typer.Option(envvar="FTUNE_URL", help="API base URL.")]
KeyOpt = Annotated[
    str | None, typer.Option(envvar="FTUNE_API_KEY", help="API key (default: embedded key).")
]
DEFAULT_URL = "http://127.0.0.1:8000"


def _client(url: str, api_key: str | None):
    from client import FtuneClient

    if not api_key:
        from core.settings import get_settings

        key_file = get_settings().data_dir / "api_key"
        if not key_file.exists():
            console.print("[red]No API key: set FTUNE_API_KEY or run `ftune up` first.[/red]")
            raise typer.Exit(2)
        api_key = key_file.read_text().strip()
    return FtuneClient(url, api_key)


def _fail(e: Exception) -> None:
    console.print(f"[red]{e}[/red]")
    raise typer.Exit(1)


# ---------------------------------------------------------------- running the service


@app.command()
def migrate() -> None:
    """Bring the database schema to the latest migration."""
    from core.db.migrate import upgrade_head
    from core.settings import get_settings

    settings = get_settings()
    if settings.is_sqlite:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    assert settings.database_url is not None
    upgrade_head(settings.database_url)


@app.command("create-key")
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


@app.command()
def api(
    host: str = "127.0.0.1",
    port: int = 8000,
) -> None:
    """Run the API server (uvicorn)."""
    from cli.embedded import api_argv

    os.execv(sys.executable, api_argv(host, port))


@app.command()
def worker(
    name: Annotated[str, typer.Option(help="Celery node name.")] = "ftune@%h",
) -> None:
    """Run the worker of this node: one job per free GPU set at once (see README, the fleet)."""
    from cli.embedded import worker_argv
    from core.settings import get_settings

    os.execv(sys.executable, worker_argv(get_settings().queue_name, name))


@app.command()
def up(
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: Annotated[Path | None, typer.Option(envvar="FTUNE_DATA_DIR")] = None,
) -> None:
    """Embedded mode: API + one worker on this machine, SQLite and a server-less broker."""
    from cli.embedded import EmbeddedStack

    stack = EmbeddedStack(data_dir=data_dir or Path(".ftune"), host=host, port=port)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as e:
        stack.stop()
        _fail(e)
    console.print(f"ftune is up at [bold]{stack.url}[/bold]  (data: {stack.data_dir})")
    console.print(f"API key: {stack.api_key}   (also in {stack.data_dir / 'api_key'})")
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
        stack.stop()


# ---------------------------------------------------------------- using the service


def _load_spec(path: Path) -> dict[str, Any]:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path} does not hold a JSON/YAML object")
    return data


def _print_result(job: dict[str, Any]) -> None:
    if job["status"] == "succeeded":
        console.print(f"[green]{job['id']} succeeded[/green]")
    else:
        err = job.get("error") or {}
        console.print(f"[red]{job['id']} {job['status']}[/red] {err.get('code', '')}")
        if err.get("message"):
            console.print(err["message"])


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML or JSON.")],
    train: Annotated[Path | None, typer.Option(help="Upload this file as the dataset.")] = None,
    eval: Annotated[Path | None, typer.Option(help="Upload this file as eval data.")] = None,
    follow: Annotated[bool, typer.Option(help="Follow with a progress bar.")] = True,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Submit a job spec; optionally upload its data first; follow it to the end."""
    from cli.follow import follow_job
    from client import FtuneAPIError

    spec = _load_spec(spec_file)
    with _client(url, api_key) as c:
        try:
            if train is not None:
                spec.setdefault("dataset", {})["file_id"] = c.upload_file(train)["id"]
            if eval is not None:
                spec.setdefault("dataset", {})["eval_file_id"] = c.upload_file(eval)["id"]
            job = c.create_job(spec)
        except FtuneAPIError as e:
            _fail(e)
        out.print(job["id"])
        if follow:
            job = follow_job(c, job["id"])
            _print_result(job)
            if job["status"] != "succeeded":
                raise typer.Exit(1)


@app.command()
def status(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Print a job as JSON."""
    from client import FtuneAPIError

    with _client(url, api_key) as c:
        try:
            out.print_json(data=c.get_job(job_id))
        except FtuneAPIError as e:
            _fail(e)


@app.command("list")
def list_jobs(
    status: str | None = None, limit: int = 20, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None
) -> None:
    """List jobs, newest first."""
    with _client(url, api_key) as c:
        page = c.list_jobs(status=status, limit=limit)
    table = Table("id", "name", "status", "step", "loss", "created")
    for j in page["data"]:
        p, m = j.get("progress") or {}, j.get("metrics") or {}
        loss = m.get("train_loss")
        table.add_row(
            j["id"],
            j.get("name") or "",
            j["status"],
            f"{p.get('step', 0)}/{p.get('total_steps') or '?'}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "",
            j["created_at"],
        )
    out.print(table)


@app.command()
def logs(
    job_id: str,
    tail: int = 200,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Print the trainer log's last lines; -f keeps printing new lines until the job ends."""
    with _client(url, api_key) as c:
        lines = c.logs(job_id, tail=tail)
        for line in lines:
            out.print(line, markup=False, highlight=False)
        while follow:
            job = c.get_job(job_id)
            time.sleep(1.0)
            new = c.logs(job_id, tail=1000)
            # Print what follows the last line we printed.
            if lines and lines[-1] in new:
                idx = len(new) - 1 - new[::-1].index(lines[-1])
                fresh = new[idx + 1 :]
            else:
                fresh = new
            for line in fresh:
                out.print(line, markup=False, highlight=False)
            lines = new or lines
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break


@app.command()
def cancel(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Request a cancel; the worker stops the trainer and every rank."""
    with _client(url, api_key) as c:
        out.print(c.cancel_job(job_id)["status"])


@app.command()
def download(
    job_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to unzip into.")] = Path(
        "adapter"
    ),
    checkpoint: int | None = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Download the trained adapter (or a checkpoint's) and unzip it."""
    import zipfile

    from client import FtuneAPIError

    output.mkdir(parents=True, exist_ok=True)
    zpath = output / f"{job_id}.zip"
    with _client(url, api_key) as c:
        try:
            c.download_adapter(job_id, zpath, checkpoint=checkpoint)
        except FtuneAPIError as e:
            _fail(e)
    with zipfile.ZipFile(zpath) as z:
        z.extractall(output)
    zpath.unlink()
    out.print(str(output))


@app.command()
def estimate(
    spec_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML or JSON.")],
    rows: Annotated[int | None, typer.Option(help="Training rows, for the step count.")] = None,
) -> None:
    """Parameters, per-process memory and steps of a spec, computed locally on the meta device."""
    from cli.estimate import estimate as run_estimate
    from core.spec import SpecError, parse_job_spec

    try:
        spec = parse_job_spec(_load_spec(spec_file))
    except SpecError as e:
        _fail(e)
    if rows is None and spec.dataset.path:
        from core.datafiles import DataFileError, data_files, inspect_file

        try:
            rows = sum(inspect_file(f).rows for f in data_files(Path(spec.dataset.path)))
        except (OSError, DataFileError):
            rows = None
    try:
        est = run_estimate(spec, spec.model.name_or_path, rows=rows)
    except (OSError, ValueError) as e:
        _fail(e)
    table = Table("figure", "value", title=f"{spec.model.name_or_path} ({spec.distributed.strategy})")
    table.add_row("parameters", f"{est.total_params:,}")
    table.add_row("trainable", f"{est.trainable_params:,} ({est.trainable_params / est.total_params:.3%})")
    table.add_row("processes", str(est.world_size))
    table.add_row("weights dtype", est.weights_dtype)
    table.add_row("per process: weights", f"{est.gpu_weights_mb:,.0f} MB")
    table.add_row("per process: grads + optimizer", f"{est.gpu_training_state_mb:,.0f} MB")
    table.add_row("per process: activations (rough)", f"{est.gpu_activations_mb:,.0f} MB")
    table.add_row("per process: total", f"{est.gpu_total_mb:,.0f} MB")
    table.add_row("offloaded to CPU per process", f"{est.cpu_offloaded_mb:,.0f} MB")
    table.add_row("optimizer steps", str(est.steps) if est.steps is not None else "? (give --rows)")
    out.print(table)


@app.command()
def demo(
    data_dir: Annotated[Path, typer.Option(help="Where the demo keeps everything.")] = Path(
        ".ftune-demo"
    ),
    steps: int = 40,
) -> None:
    """Build a tiny model and dataset, run the embedded stack, train, download, load."""
    from cli.demo import run_demo
    from core.logging import quiet_library_loggers

    quiet_library_loggers()

    run_demo(data_dir, steps=steps)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":
    # `python -m cli.main ...` (the embedded stack runs migrate this way).
    app()
