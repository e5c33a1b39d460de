"""Where a job runs when its spec does not say (an OpenAI-style job: its users never choose
sharding): the strategy and process count, from the model's memory estimate
(core/model/estimate.py) and the GPUs of the registered fleet.

Pure: memory figures and the fleet's GPUs in, a ``Placement`` out.

The rule, in order:
1. The catalog names a GPU count: that many processes (FSDP full shard when more than one).
2. No GPU worker in the fleet, or no estimate (a hub model: the API downloads nothing): one
   process (a CPU worker runs one process per job).
3. The whole job (weights, gradients and optimizer state, activations) fits one GPU of
   some worker, with HEADROOM to spare: one process, no sharding.
4. Else FSDP full shard over the fewest GPUs of one worker on which the sharded state plus
   the activations fits each GPU.
5. Else one process, saying that it does not fit: the fleet check or the run says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Share of a GPU's memory the estimate may fill: allocator fragmentation, CUDA context and
# the estimate's own error need the rest.
HEADROOM = 0.85


@dataclass(frozen=True)
class MemoryNeed:
    """One process's memory with no sharding, in MiB (core/model/estimate.py's three parts)."""

    weights_mb: float
    training_state_mb: float
    activations_mb: float

    def per_gpu(self, shards: int) -> float:
        """FSDP full shard over ``shards`` GPUs splits weights and state, not activations."""
        return (self.weights_mb + self.training_state_mb) / shards + self.activations_mb


@dataclass(frozen=True)
class GpuWorker:
    gpus: int
    memory_mb: float  # of its smallest GPU


@dataclass(frozen=True)
class Placement:
    strategy: str  # "none" | "fsdp"
    num_processes: int
    reason: str


def choose_placement(need: MemoryNeed | None, fleet: Sequence[GpuWorker],
                     catalog_gpus: int | None = None) -> Placement:
    if catalog_gpus is not None:
        return Placement("none" if catalog_gpus == 1 else "fsdp", catalog_gpus,
                         f"the model catalog asks for {catalog_gpus} GPU(s)")
    gpu_workers = [w for w in fleet if w.gpus > 0]
    if not gpu_workers:
        return Placement("none", 1, "no GPU worker registered: one process")
    if need is None:
        return Placement("none", 1, "no memory estimate (the model is not read by the API): "
                         "one process")
    one = need.per_gpu(1)
    largest = max(w.memory_mb for w in gpu_workers)
    if one <= largest * HEADROOM:
        return Placement("none", 1, f"~{one:.0f} MiB fits one GPU of {largest:.0f} MiB")
    best: tuple[int, float] | None = None
    for w in gpu_workers:
        for n in range(2, w.gpus + 1):
            if need.per_gpu(n) <= w.memory_mb * HEADROOM:
                if best is None or n < best[0]:
                    best = (n, w.memory_mb)
                break
    if best is not None:
        n, mem = best
        return Placement("fsdp", n, f"~{one:.0f} MiB does not fit one GPU; FSDP over {n} GPUs "
                         f"of {mem:.0f} MiB needs ~{need.per_gpu(n):.0f} MiB each")
    most = max(w.gpus for w in gpu_workers)
    return Placement("none", 1, f"~{one:.0f} MiB fits no worker's GPUs, even sharded over "
                     f"{most}")
