"""What a worker without a GPU can run honestly, in one place.

The worker asks before it builds anything (worker/runner.py), the accelerate YAML generator
refuses to write a config for it (worker/accelerate_config.py), and the trainer checks again
before loading weights (core/train/job.py: a job directory can be run by hand).

FSDP on CPU: accelerate 1.15 has no supported CPU FSDP. Left alone, an FSDP YAML on a CPU
machine trains one full, unsharded copy per rank and reports success. The trainer can switch
FSDP2 on for real over gloo (core/train/sharding.py: ``enable_cpu_fsdp2``), and then proves the
parameters are sharded; the operator opts in with ``FTUNE_CPU_FSDP2`` (off by default: it
touches a private accelerate attribute). FSDP1 stays refused: its FULL_STATE_DICT gather
segfaults on CPU (torch ``_flat_param.py``), so no consolidated adapter could be saved.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.spec import JobSpec


@dataclass(frozen=True)
class Refusal:
    """Why a job cannot run on this hardware: ``param`` is the spec field to change,
    ``message`` starts with the value that field has ("fsdp needs a GPU worker ...")."""

    param: str
    message: str

    def __str__(self) -> str:
        return f"{self.param} {self.message}"


def cpu_refusal(spec: JobSpec, *, cpu_fsdp2: bool) -> Refusal | None:
    """The first thing in ``spec`` that a CPU-only worker cannot run honestly, or None.

    ``cpu_fsdp2``: the operator lets this worker run FSDP2 over gloo (FTUNE_CPU_FSDP2).
    """
    dist, t = spec.distributed, spec.training
    if dist.strategy == "fsdp":
        if dist.fsdp.version == 1:
            return Refusal(
                "distributed.fsdp.version",
                "1 needs a GPU worker: on CPU its final FULL_STATE_DICT gather crashes, so "
                "no consolidated adapter could be saved (use fsdp.version 2)",
            )
        if not cpu_fsdp2:
            return Refusal(
                "distributed.strategy",
                "fsdp needs a GPU worker: on CPU accelerate does not shard and every process "
                "would train its own full copy (an operator can allow FSDP2 on CPU workers "
                "with FTUNE_CPU_FSDP2)",
            )
    if t.mixed_precision != "no":
        return Refusal(
            "training.mixed_precision",
            f"{t.mixed_precision} needs a GPU worker; this run is on cpu "
            "(use mixed_precision no, or submit to a GPU worker)",
        )
    if spec.model.attn_implementation == "flash_attention_2":
        return Refusal(
            "model.attn_implementation",
            "flash_attention_2 needs a GPU worker",
        )
    return None


def runs_cpu_fsdp2(spec: JobSpec, device: str) -> bool:
    """Whether this run is FSDP2 on CPU processes (the trainer's gloo route)."""
    return device == "cpu" and spec.distributed.strategy == "fsdp"
