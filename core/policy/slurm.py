"""What the SLURM pool can run: the admission rule for multi-machine jobs.

One machine's worth of processes runs on any worker; a job over several machines runs only
on a SLURM pool (the SLURM executor, worker/slurm/), and only up to its partition's limits.
Pool limits come from the operator's settings today (``pool_from_settings``); a fleet
registry can hand in the same ``SlurmPool`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.infra.errors import ErrorCode
from core.infra.settings import Settings
from core.policy.hardware import cpu_refusal
from core.policy.refusal import Refusal
from core.spec import JobSpec

_HW = ErrorCode.unsupported_hardware


@dataclass(frozen=True)
class SlurmPool:
    """A partition's limits: nodes one job may take, and what each node holds."""

    partition: str
    max_nodes: int
    gpus_per_node: int
    cpus_per_node: int
    single_node: bool = False  # single-machine jobs go to SLURM too


def pool_from_settings(settings: Settings) -> SlurmPool | None:
    if settings.slurm_partition is None:
        return None
    return SlurmPool(settings.slurm_partition, settings.slurm_max_nodes,
                     settings.slurm_gpus_per_node, settings.slurm_cpus_per_node,
                     settings.slurm_single_node)


def runs_on_slurm(spec: JobSpec, pool: SlurmPool | None) -> bool:
    """Whether a worker with ``pool`` hands this job to SLURM (else it runs it locally)."""
    return pool is not None and (spec.distributed.num_machines > 1 or pool.single_node)


def slurm_pool_refusal(spec: JobSpec, pool: SlurmPool | None) -> Refusal | None:
    """Why ``spec`` cannot run on ``pool`` (None: no pool configured), or None if it can.
    Single-machine jobs pass when they are not sent to SLURM (``runs_on_slurm``)."""
    dist = spec.distributed
    if pool is None:
        if dist.num_machines > 1:
            return Refusal(
                _HW, "distributed.num_machines",
                "no SLURM pool is configured: jobs run on one machine only",
                text=f"distributed.num_machines={dist.num_machines}: no SLURM pool is "
                "configured, so jobs run on one machine only (use num_machines 1)")
        return None
    if not runs_on_slurm(spec, pool):
        return None
    if dist.num_machines > pool.max_nodes:
        return Refusal(
            _HW, "distributed.num_machines",
            f"partition {pool.partition} allows at most {pool.max_nodes} node(s) per job",
            text=f"distributed.num_machines={dist.num_machines}: partition {pool.partition} "
            f"allows at most {pool.max_nodes} node(s) per job")
    if dist.main_process_ip:
        return Refusal(
            _HW, "distributed.main_process_ip",
            "chosen by SLURM (the first node of the allocation): leave it unset")
    per_node = dist.processes_per_node
    if pool.gpus_per_node == 0:
        if per_node > pool.cpus_per_node:
            return Refusal(
                _HW, "distributed.num_processes",
                f"{per_node} processes per node but a node of partition {pool.partition} has "
                f"{pool.cpus_per_node} CPU(s)")
        # Real FSDP2 over gloo on SLURM CPU nodes is not offered (the operator switch is
        # per worker, not per partition).
        return cpu_refusal(spec, cpu_fsdp2=False)
    if per_node > pool.gpus_per_node:
        return Refusal(
            _HW, "distributed.num_processes",
            f"{per_node} processes per node but a node of partition {pool.partition} has "
            f"{pool.gpus_per_node} GPU(s)")
    return None


def node_cpus(pool: SlurmPool, processes_per_node: int) -> int:
    """CPUs a job asks for on each node: one per rank on a CPU partition; on a GPU
    partition the node's CPUs in proportion to the GPUs it takes."""
    if pool.gpus_per_node == 0:
        return max(1, processes_per_node)
    return max(1, pool.cpus_per_node * processes_per_node // pool.gpus_per_node)
