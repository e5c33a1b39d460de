"""`ftune` commands that use the service: submit, usage, grade, status, list, logs, cancel,
pause, resume, download (and the spec and upload helpers `ftune estimate --server` shares)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from cli.common import DataFileOpt, EvalFileOpt, KeyOpt, UrlOpt, console, fail, out
from cli.connect import connect

commands = typer.Typer()  # the commands that use the service; cli/main.py adds them to `ftune`


def load_spec(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        fail(ValueError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}"))
    if not isinstance(data, dict):
        fail(ValueError(f"{path} does not hold a JSON/YAML object"))
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


def upload_data(c: Any, spec: dict[str, Any], train: Path | None, eval: Path | None) -> list[str]:
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


def delete_uploads(c: Any, file_ids: list[str]) -> None:
    """Uploads nobody will use (the submit was refused, or a dry run is done) are deleted."""
    for file_id in file_ids:
        try:
            c.delete_file(file_id)
        except Exception as e:  # noqa: BLE001 - the refusal is the story; say what is left
            console.print(f"could not delete upload {file_id}: {e}", markup=False)

@commands.command()
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

    spec = load_spec(spec_file)
    with connect(url, api_key) as c:
        uploaded = upload_data(c, spec, train, eval)
        try:
            job = c.create_job(spec)
        except FtuneAPIError:
            delete_uploads(c, uploaded)
            raise
        out.print(job["id"])
        if follow:
            final = follow_job(c, job["id"])
            _print_result(final)
            if final["status"] != "succeeded":
                raise typer.Exit(1)


@commands.command()
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


@commands.command()
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
    grader = load_spec(grader_file)
    items: list[dict[str, Any]] = [{}]
    if item is not None:
        try:
            text = Path(item[1:]).read_text() if item.startswith("@") else item
        except OSError as e:
            fail(ValueError(f"--item: {e}"))
        try:
            items = ([json.loads(line) for line in text.splitlines() if line.strip()]
                     if item.endswith(".jsonl") else [json.loads(text)])
        except json.JSONDecodeError as e:
            fail(ValueError(f"--item is not JSON: {e}"))
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


@commands.command()
def status(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Print a job as JSON."""
    with connect(url, api_key) as c:
        out.print_json(data=c.get_job(job_id))


@commands.command("list")
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


@commands.command()
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


@commands.command()
def cancel(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Request a cancel; the worker stops the trainer and every rank."""
    with connect(url, api_key) as c:
        out.print(c.cancel_job(job_id)["status"])


@commands.command()
def pause(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Pause a job: its worker saves a checkpoint, stops every rank and frees the GPUs."""
    with connect(url, api_key) as c:
        out.print(c.pause_job(job_id)["status"])


@commands.command()
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


@commands.command()
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
