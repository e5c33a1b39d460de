"""The `ftune` command: run the service (up, api, worker, migrate, create-key) and use it
(submit, status, list, logs, cancel, pause, resume, download, grade, demo)."""

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
    workers: Annotated[int, typer.Option(
        min=1, envvar="FTUNE_API_WORKERS",
        help="API processes (uvicorn workers). One process serves ~600 job reads a second "
        "on one core (docs/benchmarks.md); give a busy dashboard one per core.")] = 1,
) -> None:
    """Run the API server (uvicorn)."""
    from cli.embedded import api_argv

    os.execv(sys.executable, api_argv(host, port, workers))


@app.command()
def worker(
    name: Annotated[str, typer.Option(help="Celery node name.")] = "ftune@%h",
) -> None:
    """Run the worker of this node: one job per free GPU set at once (see README, the fleet)."""
    from cli.embedded import worker_argv
    from core.settings import get_settings

    os.execv(sys.executable, worker_argv(get_settings().queue_name, name))


@app.command()
def webhooks() -> None:
    """Run the webhook sender on its own (workers also send unless
    FTUNE_WEBHOOK_SENDER_IN_WORKER=false). Stops on SIGTERM or Ctrl-C."""
    import threading

    from core.db.session import get_sessionmaker
    from core.logging import configure_logging
    from core.settings import get_settings
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
        u = job.get("usage") or {}
        if u:
            cost = f", cost {u['cost']:.4f} {u['currency']}" if u.get("cost") is not None else ""
            console.print(f"{u['trained_tokens']:,} tokens trained, {u['gpu_seconds']:,.0f} "
                          f"GPU-seconds over {u['attempts']} attempt(s){cost}")
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
def usage(
    start: Annotated[str | None, typer.Option("--from", help="First UTC day, YYYY-MM-DD.")] = None,
    end: Annotated[str | None, typer.Option("--to", help="Last UTC day, YYYY-MM-DD.")] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Tokens, GPU-seconds and cost of your jobs by day (default: the last 30 days)."""
    from client import FtuneAPIError

    with _client(url, api_key) as c:
        try:
            report = c.usage(start, end)
        except FtuneAPIError as e:
            _fail(e)
    table = Table("day", "jobs", "attempts", "tokens", "GPU-seconds", "cost",
                  title=f"usage {report['start']} .. {report['end']}")
    for d in [*report["data"], {**report["total"], "date": "total", "jobs": ""}]:
        if d["date"] != "total" and not d["attempts"]:
            continue
        cost = f"{d['cost']:.4f} {d['currency']}" if d.get("cost") is not None else "-"
        table.add_row(d["date"], str(d["jobs"]), str(d["attempts"]), f"{d['trained_tokens']:,}",
                      f"{d['gpu_seconds']:,.0f}", cost)
    out.print(table)


@app.command()
def grade(
    grader_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False,
                                                help="The grader, YAML or JSON (OpenAI's shape).")],
    sample: Annotated[str | None, typer.Option(help="The model's answer to grade.")] = None,
    item: Annotated[str | None, typer.Option(
        help="The dataset row as JSON, or @file.json / @file.jsonl (every row, one by one).")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Check a grader, and with --sample grade an answer against --item, on the server (the
    same code and sandbox a GRPO job uses). Exits 1 on a problem or a grader error."""
    from client import FtuneAPIError

    grader = _load_spec(grader_file)
    items: list[dict[str, Any]] = [{}]
    if item is not None:
        text = Path(item[1:]).read_text() if item.startswith("@") else item
        try:
            items = ([json.loads(line) for line in text.splitlines() if line.strip()]
                     if item.endswith(".jsonl") else [json.loads(text)])
        except json.JSONDecodeError as e:
            _fail(ValueError(f"--item is not JSON: {e}"))
    failed = False
    with _client(url, api_key) as c:
        try:
            checked = c.validate_grader(grader)
            if sample is None:
                out.print_json(data=checked)
                return
            for row, it in enumerate(items, start=1):
                r = c.run_grader(grader, sample, it)
                if len(items) > 1:
                    r = {"row": row, **r}
                out.print_json(data=r)
                failed = failed or bool(r["errors"])
        except FtuneAPIError as e:
            _fail(e)
    if failed:
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
def pause(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Pause a job: its worker saves a checkpoint, stops every rank and frees the GPUs."""
    from client import FtuneAPIError

    with _client(url, api_key) as c:
        try:
            out.print(c.pause_job(job_id)["status"])
        except FtuneAPIError as e:
            _fail(e)


@app.command()
def resume(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Queue a paused job again; it continues from the checkpoint it paused at."""
    from client import FtuneAPIError

    with _client(url, api_key) as c:
        try:
            out.print(c.resume_job(job_id)["status"])
        except FtuneAPIError as e:
            _fail(e)


@app.command()
def download(
    job_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to unzip into.")] = Path(
        "adapter"
    ),
    checkpoint: int | None = None,
    tensorboard: Annotated[
        bool, typer.Option("--tensorboard", help="The TensorBoard event files instead.")
    ] = False,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Download the trained adapter (or a checkpoint's, or the TensorBoard files) and unzip it."""
    import zipfile

    from client import FtuneAPIError

    output.mkdir(parents=True, exist_ok=True)
    zpath = output / f"{job_id}.zip"
    with _client(url, api_key) as c:
        try:
            if tensorboard:
                c.download_tensorboard(job_id, zpath)
            else:
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
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            envvar="FTUNE_ESTIMATE_URL",
            help="Ask this API for a dry run (exact tokens, time and cost from its fleet).",
        ),
    ] = None,
    train: Annotated[Path | None, typer.Option(help="With --server: upload as the dataset.")] = None,
    api_key: KeyOpt = None,
) -> None:
    """Tokens, steps, per-process memory (and, from a server, expected time and cost) of a
    spec. Locally: the model on the meta device, tokens counted when dataset.path is local."""
    if server is not None:
        _estimate_remote(spec_file, server, api_key, train)
        return
    from core.estimate import count_tokens, optimizer_steps
    from core.estimate import estimate as run_estimate
    from core.spec import SpecError, parse_job_spec

    try:
        spec = parse_job_spec(_load_spec(spec_file))
    except SpecError as e:
        _fail(e)
    count = None
    if spec.dataset.path and Path(spec.model.name_or_path).exists():
        try:
            eval_path = Path(spec.dataset.eval_path) if spec.dataset.eval_path else None
            count = count_tokens(spec, spec.model.name_or_path, Path(spec.dataset.path), eval_path)
        except Exception as e:  # noqa: BLE001 - a CLI: say why and estimate the rest
            console.print(f"[yellow]tokens not counted: {e}[/yellow]")
    if rows is None and count is None and spec.dataset.path:
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
    steps = est.steps
    if count is not None:
        steps, per_epoch = optimizer_steps(count.batch_rows, spec)
        table.add_row("tokens per epoch", f"{count.tokens:,} ({count.loss_tokens:,} with a loss)")
        if count.generated_tokens:
            table.add_row("generated per epoch (at most)",
                          f"{count.generated_tokens:,} (answers x max_completion_length)")
        table.add_row("tokens in all", f"{round(count.tokens * steps / per_epoch):,}")
    table.add_row("optimizer steps", str(steps) if steps is not None else "? (give --rows)")
    table.add_row("objective", est.objective)
    table.add_row("compute per row vs sft", f"{est.compute_vs_sft:.2f}x")
    table.add_row("expected time", "ask a server (--server): it knows its fleet's throughput")
    out.print(table)


def _estimate_remote(spec_file: Path, url: str, api_key: str | None, train: Path | None) -> None:
    from client import FtuneAPIError

    spec = _load_spec(spec_file)
    with _client(url, api_key) as c:
        try:
            if train is not None:
                spec.setdefault("dataset", {})["file_id"] = c.upload_file(train)["id"]
            est = c.estimate(spec)
        except FtuneAPIError as e:
            _fail(e)
    table = Table("figure", "value", title="dry run")
    data, memory = est.get("data"), est.get("memory")
    if data:
        table.add_row("rows / examples", f"{data['rows']:,} / {data['examples']:,}")
        table.add_row("tokens per epoch",
                      f"{data['tokens_per_epoch']:,} ({data['loss_tokens_per_epoch']:,} with a loss)")
    if est.get("trained_tokens") is not None:
        table.add_row("tokens in all", f"{est['trained_tokens']:,}")
    table.add_row("optimizer steps", str(est.get("steps")))
    if memory:
        table.add_row("processes", str(memory["processes"]))
        table.add_row("per process: total", f"{memory['total_mb']:,.0f} MB")
    if est.get("tokens_per_second") is not None:
        table.add_row("fleet throughput",
                      f"{est['tokens_per_second']:,.1f} tokens/s ({est['history_jobs']} jobs)")
    if est.get("wall_seconds") is not None:
        table.add_row("expected time", f"{est['wall_seconds']:,.0f} s")
        table.add_row("GPU-seconds", f"{est['gpu_seconds']:,.0f}")
    if est.get("cost") is not None:
        table.add_row("cost", f"{est['cost']:,.4f} {est['currency']}")
    for note in est.get("notes") or []:
        table.add_row("note", note)
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
