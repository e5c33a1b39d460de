"""Following a job with a live progress bar: `ftune submit --follow` and `ftune demo`."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

console = Console(stderr=True, soft_wrap=True)


def phase_text(job: dict[str, Any]) -> str:
    """What the job does before its first step ("loading model: 3 of 24 tensors"); nothing
    once it trains (the bar says it)."""
    phase = job.get("phase") or {}
    if not phase or phase.get("phase") == "training":
        return ""
    return str(phase.get("message") or phase.get("phase"))


def follow_job(client: Any, job_id: str, poll_seconds: float = 1.0) -> dict[str, Any]:
    """Show a live progress bar (step, loss, ETA) until the job ends; return the last job."""
    columns = (
        TextColumn("[bold]{task.fields[status]:<10}"),
        BarColumn(),
        TextColumn("step {task.fields[steps]}"),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[phase]}"),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(job_id, total=None, status="queued", loss="-", steps="-", phase="")
        for job in client.follow(job_id, poll_seconds=poll_seconds):
            p, m = job.get("progress") or {}, job.get("metrics") or {}
            loss = m.get("train_loss")
            bar.update(
                task,
                completed=p.get("step") or 0,
                total=p.get("total_steps") or None,
                status=job["status"],
                steps=f"{p.get('step') or 0}/{p.get('total_steps') or '?'}",
                loss=f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
                phase=phase_text(job),
            )
    return job
