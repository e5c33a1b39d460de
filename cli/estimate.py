"""`ftune estimate`: tokens, steps and memory of a spec, locally (the model on the meta device,
tokens counted when the data is local) or from a server's dry run (with time and cost)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from cli.common import KeyOpt, UrlOpt, console, fail, out
from cli.connect import connect
from cli.jobs import delete_uploads, load_spec, upload_data

commands = typer.Typer()  # `ftune estimate`; cli/main.py adds them to `ftune`


@commands.command()
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
    from core.data.counts import count_rows
    from core.model.spec_estimate import estimate_spec
    from core.spec import SpecError, parse_job_spec

    raw = load_spec(spec_file)
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
        fail(e)
    train = Path(spec.dataset.path) if spec.dataset.path else None
    eval_path = Path(spec.dataset.eval_path) if spec.dataset.eval_path else None
    local_model = Path(spec.model.name_or_path).exists()  # tokens are counted with its tokenizer
    if rows is None and train is not None and not local_model:
        rows = count_rows(train)
    # The same estimate as a server's dry run (api/services/estimates.py).
    result = estimate_spec(spec, spec.model.name_or_path, train if local_model else None,
                           eval_path, rows=rows)
    count = result.count
    for note in result.notes:
        if note.startswith("tokens not counted"):
            console.print(f"[yellow]{escape(note)}[/yellow]")
    if show and count is not None and train is not None:
        _print_local_preview(spec, train, show)
    est = result.memory
    if est is None:
        fail(ValueError("; ".join(n for n in result.notes if n.startswith("memory"))))
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
    steps = result.steps if result.steps is not None else est.steps
    if count is not None:
        table.add_row("tokens per epoch", f"{count.tokens:,} ({count.loss_tokens:,} with a loss)")
        if count.generated_tokens:
            table.add_row("generated per epoch (at most)",
                          f"{count.generated_tokens:,} (answers x max_completion_length)")
        table.add_row("tokens in all", f"{result.trained_tokens:,}")
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
    spec = load_spec(spec_file)
    with connect(url, api_key) as c:
        uploaded = upload_data(c, spec, train, None)
        try:
            est = c.estimate(spec, preview=show)
        finally:
            delete_uploads(c, uploaded)  # a dry run records nothing: neither is the upload kept
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
