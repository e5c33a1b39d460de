"""Logs for every process: one JSON object per line (or plain text for a terminal).

Each line has ``time``, ``level``, ``logger`` and ``message``, plus the job and tenant it
concerns (``job_id``, ``tenant_id``) and any other field, from ``extra=`` or from the log
context: ``with log_context(job_id=...)`` around a piece of work, or ``bind(tenant_id=...)``
once known (the API binds the tenant when it has authenticated the caller). The context is a
contextvar holding one dict per scope, so what a request's handler binds in a worker thread
is seen by the request's own log line too.

Secrets never belong in a log line; as a last line of defence, anything shaped like a bearer
credential or an ftune API key is masked in messages and tracebacks.
"""

from __future__ import annotations

import json as _json
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any

_context: ContextVar[dict[str, Any] | None] = ContextVar("ftune_log_context", default=None)

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
# Every secret shape in one pattern, so a line is scanned once (the API writes a line per
# request): a bearer credential (any case), an ftune API key.
_SECRET = re.compile(r"(?i:\b(bearer)\s+[^\s\"',;]+)|\bft_[A-Za-z0-9_\-]{8,}")
_HANDLER_FLAG = "_ftune_handler"


@contextmanager
def log_context(**fields: Any) -> Iterator[dict[str, Any]]:
    """Fields for every log line written inside the block (nested blocks add to them)."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield _context.get() or {}
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Add fields to the current context: seen by the whole enclosing ``log_context``, also
    from other threads that run a copy of it."""
    ctx = _context.get()
    if ctx is None:
        _context.set(dict(fields))
    else:
        ctx.update(fields)


@contextmanager
def no_bound_fields() -> Iterator[None]:
    """A block that starts with no fields, whatever was bound before it (tests that run the
    trainer's main() in their own process, then go on to other tests)."""
    token = _context.set(None)
    try:
        yield
    finally:
        _context.reset(token)


def context_fields() -> dict[str, Any]:
    return dict(_context.get() or {})


def redact(text: str) -> str:
    return _SECRET.sub(_mask, text)


def _mask(secret: re.Match[str]) -> str:
    scheme = secret.group(1)
    return f"{scheme} [redacted]" if scheme else "ft_[redacted]"


# Built once: json.dumps with options builds an encoder per call.
_encode_json = _json.JSONEncoder(default=str, ensure_ascii=False).encode


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """Context fields, then the record's extras (which win)."""
    out = {k: v for k, v in context_fields().items() if v is not None}
    for key, value in vars(record).items():
        if key not in _STANDARD and not key.startswith("_"):
            out[key] = value
    return out


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for key, value in record_fields(record).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exc_info"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            line["stack_info"] = redact(self.formatStack(record.stack_info))
        return _encode_json(line)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = record_fields(record)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return redact(text)


# Library loggers whose warnings say nothing a user can act on. bitsandbytes (imported by peft
# whenever it is installed) warns on every import, on CPUs with AVX512-BF16, that an optional
# 4-bit kernel could not be fetched from the model hub; it then uses its own kernel.
QUIET_LOGGERS = {
    "bitsandbytes.backends.cpu.ops": logging.ERROR,
    # kombu warns "No hostname was supplied" for its filesystem transport, which has none.
    "kombu.connection": logging.ERROR,
}


# Warnings libraries raise about each other's internals: nothing a user of ftune can change.
QUIET_WARNINGS = (
    # peft 0.21 reads this alias on every PeftModel it builds; transformers 5 deprecated it.
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
)


def quiet_library_loggers(device: str | None = None) -> None:
    """Silence the library chatter above, in this process. ``device`` "cpu" also tells
    DeepSpeed (which transformers imports whenever it is installed) that this process runs
    on CPU, before it guesses so with a warning; call it before transformers is imported."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def torch_device() -> str:
    """"cuda" or "cpu": what torch sees here (imports torch)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def configure_logging(
    level: str | int = "INFO", json: bool = True, stream: IO[str] | None = None
) -> logging.Handler:
    """One handler on the root logger (replacing the one a previous call installed), and
    uvicorn's loggers routed through it. Its access log is switched off: the API writes its
    own request lines (api/middleware/observe.py), with route template, duration and tenant."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_FLAG, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    setattr(handler, _HANDLER_FLAG, True)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # Each record would look up its process and thread ids and names, which neither
    # formatter writes: ~10 of the ~55 us an API request line costs.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    access.handlers.clear()
    access.propagate = False
    access.disabled = True
    quiet_library_loggers()
    return handler
