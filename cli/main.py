"""The `ftune` command: run the service (up, api, worker, migrate, create-key) and use it
(submit, status, list, logs, cancel, pause, resume, download, grade, demo)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import evals as eval_cli
from cli.connect import connect

PIPED_WIDTH = 200
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
app.add_typer(eval_cli.app, name="eval")
# soft_wrap: a line is never cut or wrapped at the terminal's width (nor at 80 columns when
# piped): ids and log lines reach `| cat`, `| grep` and files whole.
console = Console(stderr=True, soft_wrap=True)
# Tables piped to a file or a pager: wide enough that no id or path is cut to fit 80 columns.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else PIPED_WIDTH)

UrlOpt = Annotated[
    str | None,
    typer.Option(envvar="FTUNE_URL", show_default=False,
                 help="API base URL (default: the one `ftune up` serves, else "
                 "http://127.0.0.1:8000)."),
]
KeyOpt = Annotated[
    str | None, typer.Option(envvar="FTUNE_API_KEY", help="API key (default: embedded key).")
]
DataFileOpt = Annotated[
    Path | None,
    typer.Option(exists=True, dir_okay=False, readable=True, help="Upload this file as the dataset."),
]
EvalFileOpt = Annotated[
    Path | None,
    typer.Option(exists=True, dir_okay=False, readable=True, help="Upload this file as eval data."),
]


def _fail(e: Exception) -> NoReturn:
    console.print(escape(str(e)), style="red")
    raise typer.Exit(1)


# ---------------------------------------------------------------- running the service


@app.command()
def migrate() -> None:
    """Bring the database schema to the latest migration."""
    from core.db.migrate import upgrade_head
    from core.infra.settings import get_settings

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
        help="API processes (uvicorn workers). One process served 800-2,000 job reads a "
        "second on one core of a small VM (docs/benchmarks.md); give a busy dashboard one "
        "per core.")] = 1,
) -> None:
    """Run the API server (uvicorn)."""
    from cli.embedded import api_argv

    os.execv(sys.executable, api_argv(host, port, workers))


@app.command()
def worker(
    name: Annotated[str, typer.Option(help="Celery node name.")] = "ftune@%h",
) -> None:
    """Run the worker of this node: one job per free GPU set at once (see docs/fleet.md)."""
    from cli.embedded import worker_argv
    from core.infra.settings import get_settings

    os.execv(sys.executable, worker_argv(get_settings().queue_name, name))


@app.command()
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


@app.command()
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


@app.command()
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
        _fail(e)
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


@app.command()
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
        _fail(ValueError(f"the settings are invalid: {e}"))
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


# ---------------------------------------------------------------- using the service


def _load_spec(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        _fail(ValueError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}"))
    if not isinstance(data, dict):
        _fail(ValueError(f"{path} does not hold a JSON/YAML object"))
    return data


def _print_result(job: dict[str, Any]) -> None:
    if job["status"] == "succeeded":
        console.print(f"[green]{job['id']} succeeded[/green]")
        u = job.get("usage") or {}
        if u:
            cost = f", cost {u['cost']:.4f} {u['currency']}" if u.get("cost") is not None else ""
            console.print(f"{u['trained_tokens']:,} tokens trained, {u['gpu_seconds']:,.0f} "
                          f"{_compute_unit(job)} over {u['attempts']} attempt(s){cost}")
    else:
        err = job.get("error") or {}
        console.print(f"[red]{job['id']} {job['status']}[/red] {escape(err.get('code', ''))}")
        if err.get("message"):
            console.print(err["message"], markup=False)


def _compute_unit(job: dict[str, Any]) -> str:
    """GPU-seconds are process-seconds on a CPU worker: say which the number is."""
    return "CPU process-seconds" if (job.get("run") or {}).get("device") == "cpu" else "GPU-seconds"


def _upload_data(c: Any, spec: dict[str, Any], train: Path | None, eval: Path | None) -> list[str]:
    """Upload --train / --eval into the spec; the ids uploaded, for cleaning up after a refusal."""
    uploaded: list[str] = []
    for path, key in ((train, "file_id"), (eval, "eval_file_id")):
        if path is not None:
            file_id = c.upload_file(path)["id"]
            uploaded.append(file_id)
            dataset = spec.setdefault("dataset", {})
            if key == "file_id":
                dataset.pop("path", None)  # the upload replaces a path the spec may name
            dataset[key] = file_id
    return uploaded


def _delete_uploads(c: Any, file_ids: list[str]) -> None:
    """Uploads nobody will use (the submit was refused, or a dry run is done) are deleted."""
    for file_id in file_ids:
        try:
            c.delete_file(file_id)
        except Exception as e:  # noqa: BLE001 - the refusal is the story; say what is left
            console.print(f"could not delete upload {file_id}: {e}", markup=False)


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML or JSON.")],
    train: DataFileOpt = None,
    eval: EvalFileOpt = None,
    follow: Annotated[bool, typer.Option(help="Follow with a progress bar.")] = True,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Submit a job spec; optionally upload its data first; follow it to the end."""
    from cli.follow import follow_job
    from client import FtuneAPIError

    spec = _load_spec(spec_file)
    with connect(url, api_key) as c:
        uploaded = _upload_data(c, spec, train, eval)
        try:
            job = c.create_job(spec)
        except FtuneAPIError:
            _delete_uploads(c, uploaded)
            raise
        out.print(job["id"])
        if follow:
            final = follow_job(c, job["id"])
            _print_result(final)
            if final["status"] != "succeeded":
                raise typer.Exit(1)


@app.command()
def usage(
    start: Annotated[str | None, typer.Option("--from", help="First UTC day, YYYY-MM-DD.")] = None,
    end: Annotated[str | None, typer.Option("--to", help="Last UTC day, YYYY-MM-DD.")] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Tokens, GPU-seconds and cost of your jobs by day (default: the last 30 days)."""
    with connect(url, api_key) as c:
        report = c.usage(start, end)
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
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Check a grader, and with --sample grade an answer against --item, on the server (the
    same code and sandbox a GRPO job uses). Exits 1 on a problem or a grader error."""
    grader = _load_spec(grader_file)
    items: list[dict[str, Any]] = [{}]
    if item is not None:
        try:
            text = Path(item[1:]).read_text() if item.startswith("@") else item
        except OSError as e:
            _fail(ValueError(f"--item: {e}"))
        try:
            items = ([json.loads(line) for line in text.splitlines() if line.strip()]
                     if item.endswith(".jsonl") else [json.loads(text)])
        except json.JSONDecodeError as e:
            _fail(ValueError(f"--item is not JSON: {e}"))
    failed = False
    with connect(url, api_key) as c:
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
    if failed:
        raise typer.Exit(1)


@app.command()
def status(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Print a job as JSON."""
    with connect(url, api_key) as c:
        out.print_json(data=c.get_job(job_id))


@app.command("list")
def list_jobs(
    status: str | None = None, limit: int = 20, url: UrlOpt = None, api_key: KeyOpt = None
) -> None:
    """List jobs, newest first (tab-separated when piped)."""
    with connect(url, api_key) as c:
        page = c.list_jobs(status=status, limit=limit)
    header = ("id", "name", "status", "step", "loss", "created")
    rows = []
    for j in page["data"]:
        p, m = j.get("progress") or {}, j.get("metrics") or {}
        loss = m.get("train_loss")
        rows.append((
            j["id"],
            j.get("name") or "",
            j["status"],
            f"{p.get('step', 0)}/{p.get('total_steps') or '?'}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "",
            j["created_at"],
        ))  # fmt: skip
    if not out.is_terminal:
        # For scripts: whole values, one job a line, never a table squeezed to 80 columns.
        for r in (header, *rows):
            sys.stdout.write("\t".join(v.replace("\t", " ") for v in r) + "\n")
        return
    table = Table(*header)
    for r in rows:
        table.add_row(*r)
    out.print(table)


def _print_lines(lines: list[str]) -> None:
    # Plain writes: a log line is never re-wrapped or marked up.
    sys.stdout.writelines(line + "\n" for line in lines)
    sys.stdout.flush()


@app.command()
def logs(
    job_id: str,
    tail: int = 200,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Print the trainer log's last lines; -f keeps printing new lines until the job ends."""
    with connect(url, api_key) as c:
        lines = c.logs(job_id, tail=tail)
        _print_lines(lines)
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
            _print_lines(fresh)
            lines = new or lines
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break


@app.command()
def cancel(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Request a cancel; the worker stops the trainer and every rank."""
    with connect(url, api_key) as c:
        out.print(c.cancel_job(job_id)["status"])


@app.command()
def pause(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Pause a job: its worker saves a checkpoint, stops every rank and frees the GPUs."""
    with connect(url, api_key) as c:
        out.print(c.pause_job(job_id)["status"])


@app.command()
def resume(
    job_id: str,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
    num_processes: Annotated[
        int | None, typer.Option(help="Continue on this many processes (GPUs).")
    ] = None,
    strategy: Annotated[
        str | None, typer.Option(help="Continue under this distributed.strategy.")
    ] = None,
) -> None:
    """Queue a paused job again; it continues from the checkpoint it paused at, on another
    process count or strategy when asked (the global batch is kept)."""
    with connect(url, api_key) as c:
        job = c.resume_job(job_id, num_processes=num_processes, strategy=strategy)
        out.print(job["status"])


@app.command()
def download(
    job_id: str,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Directory to write into (default: adapter/, or "
                     "model/ for a full fine-tune)."),
    ] = None,
    checkpoint: int | None = None,
    tensorboard: Annotated[
        bool, typer.Option("--tensorboard", help="The TensorBoard event files instead.")
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Download the trained adapter (or a checkpoint's, or the TensorBoard files) and unzip
    it; for a full fine-tune, the model's files (or a checkpoint's model) with a progress
    bar (run it again to resume an interrupted download)."""
    import zipfile

    with connect(url, api_key) as c:
        if not tensorboard and _is_full(c.get_job(job_id), checkpoint):
            _download_model(c, job_id, output or Path("model"), checkpoint)
            return
    output = output or Path("adapter")
    output.mkdir(parents=True, exist_ok=True)
    zpath = output / f"{job_id}.zip"
    with connect(url, api_key) as c:
        if tensorboard:
            c.download_tensorboard(job_id, zpath)
        else:
            c.download_adapter(job_id, zpath, checkpoint=checkpoint)
    with zipfile.ZipFile(zpath) as z:
        z.extractall(output)
    zpath.unlink()
    out.print(str(output))


def _is_full(job: Mapping[str, Any], checkpoint: int | None) -> bool:
    """Whether the download is a whole model: the final one of a full fine-tune, or any
    of its checkpoints (each holds the model at its step)."""
    if checkpoint is None:
        return bool(job.get("model_available"))
    return ((job.get("spec") or {}).get("peft") or {}).get("method") == "full"


def _download_model(c: Any, job_id: str, output: Path, checkpoint: int | None = None) -> None:
    """The files of a fully fine-tuned model (or of its checkpoint), resumed where an
    earlier run stopped."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn


    with Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console) as bar:
        task = bar.add_task(f"{job_id} model", total=None)
        c.download_model(
            job_id, output,
            on_listing=lambda listing: bar.update(task, total=listing["total_bytes"]),
            on_bytes=lambda n: bar.advance(task, n),
            checkpoint=checkpoint,
        )
    out.print(str(output))


@app.command()
def estimate(
    spec_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML or JSON.")],
    rows: Annotated[int | None, typer.Option(help="Training rows, for the step count.")] = None,
    server: Annotated[
        bool,
        typer.Option(
            "--server",
            help="Ask the API (--url / FTUNE_URL, or the one `ftune up` serves) for a dry run: "
            "exact tokens, time and cost from its fleet.",
        ),
    ] = False,
    train: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, readable=True,
                     help="The training data: counted here, or uploaded with --server (and "
                     "deleted after the dry run)."),
    ] = None,
    show: Annotated[
        int,
        typer.Option(
            "--show", min=0, max=20,
            help="Print the first N rows as the trainer renders them; «...» marks the tokens "
            "that carry loss.",
        ),
    ] = 0,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Tokens, steps, per-process memory (and, from a server, expected time and cost) of a
    spec. Locally: the model on the meta device, tokens counted when the data is local."""
    if server:
        _estimate_remote(spec_file, url, api_key, train, show)
        return
    from core.infra.logging import quiet_library_loggers, torch_device

    quiet_library_loggers(torch_device())
    from core.data.counts import count_tokens, optimizer_steps
    from core.model.estimate import estimate as run_estimate
    from core.spec import SpecError, parse_job_spec

    raw = _load_spec(spec_file)
    dataset = raw.setdefault("dataset", {}) if isinstance(raw.get("dataset", {}), dict) else {}
    if train is not None:
        dataset.pop("file_id", None)
        dataset["path"] = str(train.resolve())
    elif not dataset.get("file_id") and not dataset.get("path"):
        # What `ftune submit --train` fills in: the estimate needs no data of its own.
        dataset["file_id"] = "file-to-upload"
    try:
        spec = parse_job_spec(raw)
    except SpecError as e:
        _fail(e)
    count = None
    if spec.dataset.path and Path(spec.model.name_or_path).exists():
        try:
            eval_path = Path(spec.dataset.eval_path) if spec.dataset.eval_path else None
            count = count_tokens(spec, spec.model.name_or_path, Path(spec.dataset.path), eval_path)
        except Exception as e:  # noqa: BLE001 - a CLI: say why and estimate the rest
            console.print(f"[yellow]tokens not counted: {escape(str(e))}[/yellow]")
        if show and count is not None:
            _print_local_preview(spec, Path(spec.dataset.path), show)
    if rows is None and count is None and spec.dataset.path:
        from core.data.files import DataFileError, data_files, inspect_file

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
    if spec.peft.method == "full":
        # Weights + gradients + optimizer state: what a GPU must hold, whatever the batch.
        table.add_row("per process: must fit a GPU (full)", f"{est.gpu_state_mb:,.0f} MB")
    table.add_row("offloaded to CPU per process", f"{est.cpu_offloaded_mb:,.0f} MB")
    steps = est.steps
    if count is not None:
        steps, per_epoch = optimizer_steps(count.batch_rows, spec)
        table.add_row("tokens per epoch", f"{count.tokens:,} ({count.loss_tokens:,} with a loss)")
        if count.generated_tokens:
            table.add_row("generated per epoch (at most)",
                          f"{count.generated_tokens:,} (answers x max_completion_length)")
        table.add_row("tokens in all", f"{round(count.tokens * steps / per_epoch):,}")
    table.add_row("optimizer steps", str(steps) if steps is not None else "? (give --rows or --train)")
    table.add_row("objective", est.objective)
    table.add_row("compute per row vs sft", f"{est.compute_vs_sft:.2f}x")
    table.add_row("expected time", "ask a server (--server): it knows its fleet's throughput")
    out.print(table)


def _print_local_preview(spec: Any, path: Path, n: int) -> None:
    from core.data.counts import preview
    from core.data.files import check_rows
    from core.data.formats import allowed_formats

    allowed = allowed_formats(spec.model.task, spec.training.objective)
    report = check_rows(path, spec.dataset, allowed=allowed)
    if report.resolution is None or report.receipt is None:
        return
    _print_receipt(report.receipt.to_dict())
    _print_preview(preview(spec, spec.model.name_or_path, path, report.resolution, n))


def _print_receipt(data: dict[str, Any] | None) -> None:
    if not data:
        return
    how = "detected" if data.get("detected") else "as named"
    used = ", ".join(f"{c} ({r})" for r, c in data["columns_used"].items())
    out.print(f"data: {data['format']} [{data['layout']}], {how}; columns used: {used}; "
              f"ignored: {', '.join(data['columns_ignored']) or 'none'}",
              markup=False, highlight=False, soft_wrap=True)


def render_tokens(tokens: list[dict[str, Any]]) -> str:
    """Tokens as text, each run of loss-carrying tokens inside «...»."""
    parts: list[str] = []
    inside = False
    for t in tokens:
        if t["loss"] != inside:
            parts.append("«" if t["loss"] else "»")
            inside = t["loss"]
        parts.append(t["text"])
    if inside:
        parts.append("»")
    return "".join(parts)


def _print_preview(rows: list[dict[str, Any]] | None) -> None:
    for r in rows or []:
        note = "" if r.get("kept", True) else " (dropped: nothing to learn)"
        out.print(f"--- row {r['row']}: {len(r['tokens'])} tokens, {r['loss_tokens']} with a loss{note}")
        out.print(render_tokens(r["tokens"]), markup=False, highlight=False, soft_wrap=True)


def _estimate_remote(spec_file: Path, url: str | None, api_key: str | None,
                     train: Path | None, show: int = 0) -> None:
    spec = _load_spec(spec_file)
    with connect(url, api_key) as c:
        uploaded = _upload_data(c, spec, train, None)
        try:
            est = c.estimate(spec, preview=show)
        finally:
            _delete_uploads(c, uploaded)  # a dry run records nothing: neither is the upload kept
    _print_receipt(est.get("data_format"))
    _print_preview(est.get("preview"))
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
        table.add_row("note", escape(note))
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
    from core.infra.logging import quiet_library_loggers, torch_device

    quiet_library_loggers(torch_device())

    run_demo(data_dir, steps=steps)


def main() -> None:
    """The `ftune` program. A local `ftune estimate` process does nothing after the
    estimate, so it may skip importing bitsandbytes (most of its time)."""
    args = sys.argv[1:]
    if args[:1] == ["estimate"] and "--server" not in args:
        from core.model.estimate import forget_bitsandbytes

        forget_bitsandbytes()
    app()


if __name__ == "__main__":
    # `python -m cli.main ...` (the embedded stack runs migrate this way).
    main()
