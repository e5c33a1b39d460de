"""Fake what a worker and the trainer leave behind: a job dir with log, checkpoints, adapter.

Paths are recorded as the worker records them (absolute, resolved)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import update

from core.db.models import Checkpoint, Job, JobEvent, utcnow
from tests.utils.api import Api

ADAPTER_FILES = {
    "adapter_config.json": b'{"peft_type": "LORA", "r": 8}',
    "adapter_model.safetensors": b"\x00" * 4096,
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "README.md": b"# adapter\n",
}


def fake_run(
    api: Api,
    job_id: str,
    *,
    status: str = "running",
    log_lines: int = 0,
    checkpoints: tuple[int, ...] = (),
    adapter: bool = False,
    launched: bool = False,
) -> Path:
    """A job as a worker would leave it; ``launched``: with the launch the worker records."""
    root = api.settings.jobs_dir / job_id
    root.mkdir(parents=True, exist_ok=True)
    if log_lines:
        (root / "trainer.log").write_text("".join(f"line {i}\n" for i in range(1, log_lines + 1)))
    values: dict[str, Any] = {
        "status": status,
        "job_dir": str(root),
        "attempt": 1,
        "started_at": utcnow(),
    }
    if launched:
        values["launch"] = {"argv": ["accelerate", "launch", "-m", "core.train", str(root)],
                            "accelerate_yaml": "distributed_type: 'NO'\n", "env": {}}
    with api.session() as s:
        for step in checkpoints:
            ckpt = root / "checkpoints" / f"checkpoint-{step}"
            ckpt.mkdir(parents=True)
            for name, data in ADAPTER_FILES.items():
                (ckpt / name).write_bytes(data)
            (ckpt / "optimizer.pt").write_bytes(b"opt")
            (ckpt / "trainer_state.json").write_text("{}")
            s.add(
                Checkpoint(
                    job_id=job_id,
                    step=step,
                    path=str(ckpt.resolve()),
                    metrics={"loss": 1.0 / step},
                )
            )
        if adapter:
            (root / "adapter").mkdir()
            for name, data in ADAPTER_FILES.items():
                (root / "adapter" / name).write_bytes(data)
            values["adapter_path"] = str((root / "adapter").resolve())
        s.execute(update(Job).where(Job.id == job_id).values(**values))
        s.add(JobEvent(job_id=job_id, type="started", message="", data={"world_size": 1}))
        s.commit()
    return root
