"""What a run is doing before its first step, as "phase" events (rank 0).

Between the launch and the first step a run tokenizes its data, loads the base model (a
minute or more for a large one) and wraps it for its strategy (DeepSpeed may compile its
ops): without a word, a user sees "step 0/?" and guesses. Each phase is one event
``{"type": "phase", "phase": ..., "message": ...}``; the worker folds the latest into the
job's ``phase`` and the "started" event ends them (training).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from core.train.events import EventLog

# The phases in the order a run passes through them (the worker adds "starting" before the
# launch; "training" is the "started" event).
PREPARING_DATA = "preparing_data"
LOADING_MODEL = "loading_model"
PREPARING_RUN = "preparing_run"
# Weight-loading progress at most this often (an event is a line in events.jsonl and a row).
LOAD_REPORT_SECONDS = 2.0


class Phases:
    def __init__(self, events: EventLog, attempt: int) -> None:
        self.events = events
        self.attempt = attempt

    def enter(self, phase: str, message: str, **fields: Any) -> None:
        self.events.emit("phase", phase=phase, message=message, attempt=self.attempt, **fields)


def shard_files(model_path: str) -> int | None:
    """Weight files of a local model directory (None for a hub id not downloaded yet)."""
    root = Path(model_path)
    if not root.is_dir():
        return None
    return sum(1 for _ in root.glob("*.safetensors")) or sum(1 for _ in root.glob("*.bin")) or None


@contextmanager
def reporting_weight_loads(phases: Phases, model_path: str) -> Iterator[None]:
    """While the block loads a model: "loading model: N of M tensors (K shard files)".

    transformers 5 opens every shard lazily and then materialises the tensors one by one in
    one loop (core_model_loading, wrapped in its `tqdm` helper): that loop's progress is
    the load's. The helper is swapped for one that counts, for the block only; a later
    transformers without that loop gets only the opening and closing events (the phase test
    then fails, as it should, and says so)."""
    import transformers.core_model_loading as loading

    shards = shard_files(model_path)
    of_shards = f" ({shards} shard file{'s' if shards != 1 else ''})" if shards else ""
    phases.enter(LOADING_MODEL, f"loading model{of_shards}", shards=shards)
    original = getattr(loading, "tqdm", None)

    def counting(iterable: Iterable[Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        total, last = len(items), 0.0
        for n, item in enumerate(items, start=1):
            yield item
            now = time.monotonic()
            if n == total or now - last >= LOAD_REPORT_SECONDS:
                last = now
                phases.enter(LOADING_MODEL, f"loading model: {n} of {total} tensors{of_shards}",
                             loaded=n, total=total, shards=shards)

    if original is not None:
        loading.tqdm = counting  # type: ignore[assignment]
    try:
        yield
    finally:
        if original is not None:
            loading.tqdm = original
