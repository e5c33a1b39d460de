"""What the fleet can run: a spec against the inventories the workers registered
(core/db/models.py ``Worker``). The API asks at submit (a spec no worker could ever run is a
422 naming the field); the scheduler asks which workers a queued job may go to
(core/jobs/scheduler.py). One worker's rules stay in hardware.py; this module applies them to
each registered inventory and says, for the fleet as a whole, what is missing.

Pure: inventories and a spec in, a Refusal (or a number) out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.infra.errors import ErrorCode
from core.policy.hardware import cpu_refusal
from core.policy.refusal import Refusal, value_first
from core.spec import JobSpec

_HW = ErrorCode.unsupported_hardware


@dataclass(frozen=True)
class Inventory:
    """What one registered worker (or pool) has and can do."""

    id: str
    gpus: int
    executor: str = "local"
    slots: int = 1
    capabilities: dict[str, Any] = field(default_factory=dict)
    gpu_memory_mb: int = 0  # the smallest of its GPUs; 0: unknown (or no GPU)

    @property
    def max_machines(self) -> int:
        """Machines one job may span here: 1 on a local worker; a pool (SLURM) says more."""
        return int(self.capabilities.get("max_machines", 1))


def gpus_needed(spec: JobSpec, inv: Inventory) -> int:
    """GPUs the job holds on this worker: one per local process on a GPU worker, none on a
    CPU worker (there it holds one slot)."""
    if inv.gpus == 0:
        return 0
    return spec.distributed.processes_per_node


def inventory_refusal(spec: JobSpec, inv: Inventory) -> Refusal | None:
    """What this worker could never run (however long the job waited), or None."""
    dist, caps = spec.distributed, inv.capabilities
    if dist.num_machines > inv.max_machines:
        return Refusal(_HW, "distributed.num_machines",
                       f"{dist.num_machines} machines but worker {inv.id} runs jobs on "
                       f"{inv.max_machines}")
    if inv.gpus == 0:
        return cpu_refusal(spec, cpu_fsdp2=bool(caps.get("cpu_fsdp2")))
    if gpus_needed(spec, inv) > inv.gpus:
        return Refusal(_HW, "distributed.num_processes",
                       f"{spec.distributed.processes} processes but worker {inv.id} has {inv.gpus} GPUs")
    if spec.training.mixed_precision == "bf16" and not caps.get("bf16", True):
        return value_first(_HW, "training.mixed_precision",
                           "bf16 needs an Ampere or newer GPU")
    if spec.model.attn_implementation == "flash_attention_2" and not caps.get("flash_attn"):
        return value_first(_HW, "model.attn_implementation",
                           "flash_attention_2 needs a worker with flash-attn installed")
    return None


def runnable_on(spec: JobSpec, fleet: Sequence[Inventory]) -> list[Inventory]:
    """The workers of ``fleet`` that could run ``spec`` (memory aside: core/policy/memory.py)."""
    return [inv for inv in fleet if inventory_refusal(spec, inv) is None]


def fleet_refusal(spec: JobSpec, fleet: Sequence[Inventory]) -> Refusal | None:
    """Why no worker of ``fleet`` could ever run ``spec``, said for the fleet as a whole
    (``distributed.num_processes: 64 processes but the largest worker has 8 GPUs``), or
    None when one could. An empty fleet refuses nothing: the caller decides what that
    means."""
    if not fleet or any(inventory_refusal(spec, inv) is None for inv in fleet):
        return None
    dist = spec.distributed
    most_machines = max(inv.max_machines for inv in fleet)
    if dist.num_machines > most_machines:
        return Refusal(
            _HW, "distributed.num_machines",
            f"{dist.num_machines} machines but no registered multi-node pool (the workers "
            f"run jobs on at most {most_machines} machine{'s' if most_machines > 1 else ''})")
    gpu_workers = [inv for inv in fleet if inv.gpus > 0]
    if not gpu_workers:
        first = inventory_refusal(spec, fleet[0])
        assert first is not None
        return Refusal(first.code, first.param,
                       f"{first.message} (every registered worker is CPU-only)",
                       text=f"{first} (every registered worker is CPU-only)")
    largest = max(gpu_workers, key=lambda inv: inv.gpus)
    if dist.processes_per_node > largest.gpus:
        return Refusal(_HW, "distributed.num_processes",
                       f"{spec.distributed.processes} processes but the largest worker has "
                       f"{largest.gpus} GPUs")
    refusal = inventory_refusal(spec, largest)
    assert refusal is not None
    return refusal
