"""Writing events.jsonl (rank 0 only) and measuring memory per phase.

The worker tails events.jsonl into the database; every line is one JSON object written with
one write() (core.run.jobdir.append_event). JSON has no NaN/Infinity, so non-finite numbers are
written as null: a diverging loss is reported by a failure (nan_loss), not by a broken line.
"""

from __future__ import annotations

import functools
import math
import resource
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from core.run.jobdir import append_event
from core.train import dist


def _clean(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item"):  # torch / numpy scalars
        try:
            return _clean(v.item())
        except (ValueError, RuntimeError):
            pass
    return str(v)


class EventLog:
    """Appends events on rank 0; a no-op on other ranks so callers need not check."""

    def __init__(self, path: Path, enabled: bool | None = None) -> None:
        self.path = path
        self._enabled = enabled

    @property
    def enabled(self) -> bool:
        # Decided lazily: the rank is only known for sure once the process group exists.
        return dist.is_main() if self._enabled is None else self._enabled

    def emit(self, event_type: str, **fields: Any) -> None:
        if self.enabled:
            append_event(self.path, event_type, **_clean(fields))


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _maxrss_mb() -> float:
    # Linux reports ru_maxrss in KiB: the highest RSS of the process so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# Phases open right now, outermost first ("eval" runs inside "train").
_ACTIVE: list[MemoryPhase] = []


class MemoryPhase:
    """CPU RSS (and CUDA allocator) use over one phase of the run: load, train, eval, save.

    The peak is exact when the phase set a new lifetime high (ru_maxrss moved); otherwise a
    sampler thread (every 0.5 s) bounds it from below. On exit every rank's numbers are
    gathered (one all_gather_object, a collective: every rank must pass through the same
    phases in the same order) and rank 0 writes one "memory" event per rank; peak GPU
    memory is usually decided by the busiest rank, so all of them are reported.

    Phases nest: CUDA has one peak counter per process, so a phase opening inside another
    first banks the outer phase's peak so far, then resets the counter.
    """

    def __init__(
        self,
        events: EventLog,
        phase: str,
        interval: float = 0.5,
        fields: dict[str, Any] | None = None,
    ) -> None:
        self.events = events
        self.phase = phase
        self.interval = interval
        self.fields = dict(fields or {})
        self._stop = threading.Event()
        self._peak = 0.0
        self._gpu_peak = 0.0  # banked before an inner phase reset the CUDA counter
        self._gpu_reserved_peak = 0.0

    def _bank_gpu_peak(self) -> None:
        import torch

        self._gpu_peak = max(self._gpu_peak, torch.cuda.max_memory_allocated() / 2**20)
        self._gpu_reserved_peak = max(
            self._gpu_reserved_peak, torch.cuda.max_memory_reserved() / 2**20
        )

    def __enter__(self) -> Self:
        import torch

        self._t0 = time.monotonic()
        self._begin = _rss_mb()
        self._maxrss_begin = _maxrss_mb()
        self._peak = self._begin
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            for outer in _ACTIVE:
                outer._bank_gpu_peak()
            torch.cuda.reset_peak_memory_stats()
            self._gpu_begin = torch.cuda.memory_allocated() / 2**20
        _ACTIVE.append(self)
        self._thread = threading.Thread(target=self._sample, name=f"mem-{self.phase}", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, _rss_mb())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if exc_type is not None:
            # No collective on the failure path: another rank may not be here.
            return
        import torch

        end = _rss_mb()
        maxrss_end = _maxrss_mb()
        peak = max(self._peak, end)
        if maxrss_end > self._maxrss_begin:
            peak = max(peak, maxrss_end)
        record: dict[str, Any] = {
            "phase": self.phase,
            "rank": dist.rank(),
            **self.fields,
            "cpu_mb_begin": round(self._begin, 1),
            "cpu_mb_end": round(end, 1),
            "cpu_mb_peak": round(peak, 1),
            "seconds": round(time.monotonic() - self._t0, 3),
        }
        cuda = self._cuda or (torch.cuda.is_available() and torch.cuda.is_initialized())
        if cuda:
            record.update(
                gpu_mb_begin=round(getattr(self, "_gpu_begin", 0.0), 1),
                gpu_mb_end=round(torch.cuda.memory_allocated() / 2**20, 1),
            )
            self._bank_gpu_peak()
            record.update(
                gpu_mb_peak=round(self._gpu_peak, 1),
                gpu_mb_reserved_peak=round(self._gpu_reserved_peak, 1),
            )
        for r in dist.gather_objects(record):
            self.events.emit("memory", **r)


def measure_calls(obj: Any, method: str, events: EventLog, phase: str) -> None:
    """Measure every call of ``obj.<method>`` as a MemoryPhase (e.g. Trainer.evaluate, which
    the Trainer calls on every rank at the same steps, as the phase's collective needs).
    The event carries the training step the call happened at."""
    inner = getattr(obj, method)

    @functools.wraps(inner)
    def measured(*args: Any, **kwargs: Any) -> Any:
        state = getattr(obj, "state", None)
        fields = {"step": int(state.global_step)} if state is not None else {}
        with MemoryPhase(events, phase, fields=fields):
            return inner(*args, **kwargs)

    setattr(obj, method, measured)
