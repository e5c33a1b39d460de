"""Exception -> ErrorCode: who is to blame, told in words a user can act on.

The trainer never swallows an exception. Code that knows *why* something failed raises a
``TrainFailure`` (core/infra/errors.py: the data pipeline raises it too) carrying the code
and a message naming the file, field, row or setting; everything else reaches ``classify``
raw and is sorted by type and text (the libraries report OOM and a full disk as many
different exception types). ``error.json`` is written from the result, then the process
exits non-zero.
"""

from __future__ import annotations

import errno
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.infra.errors import ErrorCode, TrainFailure


def nan_loss(step: int, value: float | None = None) -> TrainFailure:
    shown = "" if value is None else f" ({value})"
    return TrainFailure(
        ErrorCode.nan_loss,
        f"the training loss became non-finite{shown} at step {step}: the run diverged. "
        "Try a lower training.learning_rate, a warmup (training.warmup_ratio), "
        "training.max_grad_norm > 0, or mixed_precision bf16 instead of fp16.",
    )


@dataclass
class Where:
    """What the recipe was doing, so a raw exception can be explained ("OOM at step 12")."""

    phase: str = "setup"
    step: int | None = None

    def __str__(self) -> str:
        return self.phase if self.step is None else f"{self.phase} (step {self.step})"


_OOM_TEXT = (
    "out of memory",  # CUDA, HIP, MPS and torch's own messages
    "can't allocate memory",  # torch's CPU allocator
    "cannot allocate memory",  # ENOMEM from the OS
    "cublas_status_alloc_failed",
)
_ENOSPC_TEXT = ("no space left on device", "os error 28", "disk quota exceeded")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and its causes (raise ... from, and implicit context), without cycles."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(t in str(e).lower() for t in _OOM_TEXT)


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors (Rust) and torch.save wrap the OS error into their own types and text.
    return any(t in str(e).lower() for t in _ENOSPC_TEXT)


def classify(exc: BaseException, where: Where | None = None) -> tuple[ErrorCode, str]:
    """Map any exception to (code, message). Order matters: a known cause anywhere in the
    chain beats the generic wrapper around it (a RuntimeError raised *from* an OOM is OOM)."""
    from core.data.reading import DataFileError

    at = f" during {where}" if where else ""
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, TrainFailure):
            return e.code, e.message
    for e in chain:
        if _is_oom(e):
            return ErrorCode.out_of_memory, (
                f"out of memory{at}: {_first_line(e)}. Lower training.per_device_train_batch_size "
                "(raise gradient_accumulation_steps to keep the effective batch), lower "
                "dataset.max_seq_length, or turn on training.gradient_checkpointing."
            )
    for e in chain:
        if _is_disk_full(e):
            name = getattr(e, "filename", None)
            what = f" writing {name}" if name else ""
            return ErrorCode.disk_full, (
                f"the disk is full{what}{at}: {_first_line(e)}. Free space in the job directory "
                "or lower training.save_total_limit."
            )
    for e in chain:
        if isinstance(e, DataFileError):
            return ErrorCode.invalid_dataset, f"the dataset cannot be read: {e}"
    return ErrorCode.trainer_crashed, f"{type(exc).__name__}{at}: {_first_line(exc)}"


def _first_line(e: BaseException, limit: int = 500) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    return line if len(line) <= limit else line[:limit] + "..."


def write_error(job_root: Path, code: ErrorCode, message: str, exc: BaseException) -> None:
    """Write error.json so that the *first* failure of this run wins.

    Every rank may fail, but usually one fails first (an OOM on rank 1) and the others then
    fail *because of it* (a collective whose peer vanished). The first cause is what the
    user needs, so an error.json written during this run is never overwritten. One left by
    an earlier attempt (older than this process) is stale and is replaced. The file appears
    atomically: written under a per-process name, then linked (fails if present) or renamed.
    """
    from core.run.jobdir import ERROR_FILE

    path = job_root / ERROR_FILE
    body = {
        "code": str(code),
        "message": message,
        "traceback": "".join(traceback.format_exception(exc))[-20_000:],
        "rank": int(os.environ.get("RANK", "0")),
        "time": time.time(),
    }
    import json

    tmp = path.with_name(f"{ERROR_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str))
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            if path.stat().st_mtime < _process_start_time():
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _process_start_time() -> float:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - /proc unreadable: treat every file as current
        return float("-inf")
