"""The few collectives the recipe itself needs (the Trainer does the rest).

Rule of thumb for every collective here: all ranks must call it the same number of times
in the same order, or the job hangs until the launcher kills it. So each is called from a
place every rank passes through identically (a step end, a phase end).
"""

from __future__ import annotations

import os
from typing import Any


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank. Before the process group exists, the launcher's env var says it."""
    if _initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if _initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


def all_reduce_max(values: list[float], device: Any) -> list[float]:
    """Element-wise max over ranks of a short vector of flags; one small collective.

    With a single process this is free: no tensor, no sync.
    """
    if world_size() <= 1 or not _initialized():
        return values
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if world_size() <= 1 or not _initialized():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def teardown() -> None:
    """Destroy the process group, if this process has one. Called on every exit path.

    torch 2.13 on gloo: a rank that reaches interpreter exit with its group still alive can
    die with SIGABRT ("terminate called without an active exception") *after* a good run,
    and its exit code would then say the job crashed. Destroying the group is local (no
    collective), so a rank may call it while its peers are gone or still saving.
    """
    if not _initialized():
        return
    import torch.distributed as dist

    dist.destroy_process_group()


def barrier() -> None:
    if world_size() > 1 and _initialized():
        import torch.distributed as dist

        dist.barrier()
