"""A memory probe for benchmarks (bench/sharding.py): what each rank really holds.

Off unless the environment names a folder in ``FTUNE_MEMORY_PROBE``: then the recipe calls
``install`` once, and each rank writes ``held-rank<r>.json`` there, with

* ``held``: the bytes of parameter, gradient and optimizer-state storage the rank holds
  right after an optimizer step (before the gradients are zeroed), counted from the tensors
  themselves (``held_bytes``): the local shard of an FSDP2 DTensor, a ZeRO-3 partition,
  DeepSpeed's flat gradient and fp32 master buffers, DDP's gradient buckets. The largest
  figure over the run's steps is kept (the optimizer state appears at the first step).
* ``save``: the final save's resident memory (``SavePeak``): at its start, its exact peak
  (the kernel's high-water mark, reset as the save begins) and, sampled every 10 ms, the
  peak of its anonymous part (heap: tensors, buffers) and of its file-backed part (pages of
  memory-mapped safetensors files, which the kernel may drop and reread at any time).

When the variable is unset the recipe reads the variable and nothing else: no callback,
no wrapped save, no sampler thread.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self

PROBE_ENV = "FTUNE_MEMORY_PROBE"
CATEGORIES = ("params", "grads", "optimizer", "buffers")


def probe_dir() -> Path | None:
    value = os.environ.get(PROBE_ENV)
    return Path(value) if value else None


# ---------------------------------------------------------------------------- held bytes


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(obj: Any, depth: int = 2) -> Iterable[Any]:
    """Tensors in ``obj``: itself, or inside lists, tuples and dicts, ``depth`` levels down."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth - 1)


class _Ledger:
    """Storage bytes by category, each storage counted once (under the first category that
    reaches it): a ZeRO partition is a view into a flat buffer, a DDP gradient may be a view
    into a bucket, FSDP's local shard a view into its padded storage. ``named`` keeps the
    same bytes by where they were found (``Adam.state[exp_avg]``,
    ``DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat``, ...), and ``shared``
    each name whose tensors were only views of storage already counted under another name:
    what a reader needs to see that nothing was counted twice, and what each buffer is."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.named: dict[str, dict[str, Any]] = {}
        self.shared: dict[str, str] = {}
        self._seen: dict[tuple[str, int], str] = {}

    def add(self, category: str, t: Any, name: str) -> None:
        t = _local(t)
        if t is None or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0:
            return
        if key in self._seen:
            if self._seen[key] != name and name not in self.named:
                self.shared[name] = self._seen[key]
            return
        self._seen[key] = name
        self.bytes[category] += storage.nbytes()
        entry = self.named.setdefault(name, {"category": category, "bytes": 0, "dtype": ""})
        entry["bytes"] += storage.nbytes()
        entry["dtype"] = str(t.dtype).removeprefix("torch.")


def _optimizers(optimizer: Any) -> list[Any]:
    """The chain of wrappers down to the real optimizer (accelerate -> DeepSpeed -> Adam)."""
    chain, seen = [], set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def ddp_bucket_bytes(model: Any) -> int:
    """Bytes of DistributedDataParallel's gradient buckets: a second copy of the gradients
    unless gradient_as_bucket_view (then the gradients are views into them)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(s) for s in sizes.split(",") if s.strip())


def held_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """Bytes of storage this rank holds for training, by category:

    params     the model's parameters (local shard / ZeRO partition, whole under DDP)
    grads      their gradients (.grad, or DeepSpeed's flat partitioned gradient buffer)
    optimizer  optimizer state (e.g. Adam's moments) and DeepSpeed's fp32 master partitions
    buffers    other tensors the distributed wrapper keeps: DDP's gradient buckets,
               DeepSpeed's reduce buckets and whatever else its optimizer holds
    """
    return held_report(model, optimizer)["held"]


def held_report(model: Any, optimizer: Any) -> dict[str, Any]:
    """``held_bytes`` (``held``), the same bytes by where they were found (``named``: name ->
    category, bytes, dtype) and the names that only held views of storage counted under
    another name (``shared``: name -> that name)."""
    ledger = _Ledger()
    params = list(model.parameters())
    for p in params:
        ledger.add("params", getattr(p, "ds_tensor", p),
                   "param.ds_tensor" if hasattr(p, "ds_tensor") else "param")
    for p in params:
        if p.grad is not None:
            ledger.add("grads", p.grad, "param.grad")
    chain = _optimizers(optimizer)
    for opt in chain:
        cls = type(opt).__name__
        for t in _tensors(getattr(opt, "grad_partitions_flat_buffer", None)):
            ledger.add("grads", t, f"{cls}.grad_partitions_flat_buffer")
    for opt in chain:
        cls = type(opt).__name__
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            for per_param in state.values():
                items = per_param.items() if isinstance(per_param, dict) else ()
                for key, value in items:
                    for t in _tensors(value, depth=0):
                        if t.dim() > 0:  # not the step counters
                            ledger.add("optimizer", t, f"{cls}.state[{key}]")
        for t in _tensors(getattr(opt, "fp32_partitioned_groups_flat", None)):
            ledger.add("optimizer", t, f"{cls}.fp32_partitioned_groups_flat")
    for opt in chain:  # anything else a ZeRO optimizer keeps (buckets, flat buffers)
        cls = type(opt).__name__
        for name, value in list(vars(opt).items()):
            if name == "state":  # counted above, less its step counters
                continue
            for t in _tensors(value):
                ledger.add("buffers", t, f"{cls}.{name}")
            buffer = getattr(value, "buffer", None)  # ZeRO-3's reduce buckets
            for t in _tensors(buffer):
                ledger.add("buffers", t, f"{cls}.{name}.buffer")
            if isinstance(value, dict):
                for v in value.values():
                    for t in _tensors(getattr(v, "buffer", None)):
                        ledger.add("buffers", t, f"{cls}.{name}[].buffer")
    held = dict(ledger.bytes)
    named = dict(ledger.named)
    buckets = ddp_bucket_bytes(model)
    if buckets:
        held["buffers"] += buckets
        named["DistributedDataParallel.reducer buckets"] = {
            "category": "buffers", "bytes": buckets, "dtype": ""}
    return {"held": held, "named": named, "shared": dict(ledger.shared)}


# ---------------------------------------------------------------------------- save peak


def _status_kb(*keys: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0])
    return out


def _statm_pages() -> tuple[int, int]:
    """(resident, file-backed + shared) pages of this process."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return int(fields[1]), int(fields[2])


class SavePeak:
    """Resident memory over a block: exact peak (VmHWM after resetting it through
    /proc/self/clear_refs), and sampled peaks of its anonymous and file-backed parts."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self.anon_peak = 0
        self.file_peak = 0
        self.result: dict[str, Any] = {}

    def _sample(self) -> None:
        while True:
            resident, shared = _statm_pages()
            self.anon_peak = max(self.anon_peak, (resident - shared) * self.page)
            self.file_peak = max(self.file_peak, shared * self.page)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Self:
        resident, shared = _statm_pages()
        self.begin = resident * self.page
        self.anon_begin = (resident - shared) * self.page
        self.file_begin = shared * self.page
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._sample, name="probe-save", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        hwm = _status_kb("VmHWM")["VmHWM"] * 1024
        resident, _ = _statm_pages()
        self.result = {
            "seconds": round(time.monotonic() - self.t0, 3),
            "rss_begin": self.begin,
            "rss_end": resident * self.page,
            # Exact when the reset worked; else the process's lifetime peak (an upper bound).
            "rss_peak": hwm,
            "rss_peak_exact": self.hwm_reset,
            "anon_begin": self.anon_begin,
            "anon_peak_sampled": self.anon_peak,
            "file_begin": self.file_begin,
            "file_peak_sampled": self.file_peak,
        }


# ---------------------------------------------------------------------------- install


def install(recipe: Any, trainer: Any, folder: Path) -> None:
    """Record held bytes at every optimizer step and the final save's memory, per rank."""
    from transformers import TrainerCallback

    from core.train import dist

    folder.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"rank": dist.rank(), "world_size": dist.world_size()}

    def write() -> None:
        path = folder / f"held-rank{dist.rank()}.json"
        path.write_text(json.dumps(record, indent=2))

    class HeldBytes(TrainerCallback):
        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # The wrapped model: DDP's buckets live on the wrapper, not on the module.
            report = held_report(trainer.model_wrapped, trainer.optimizer)
            held = report["held"]
            if sum(held.values()) >= sum(record.get("held", {}).values()):
                record.update(report)
                record["held_step"] = state.global_step + 1

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            write()

    trainer.add_callback(HeldBytes())
    save: Callable[..., Any] = recipe.save

    def measured_save(*args: Any, **kwargs: Any) -> Any:
        with SavePeak() as peak:
            out = save(*args, **kwargs)
        record["save"] = peak.result
        write()
        return out

    recipe.save = measured_save
