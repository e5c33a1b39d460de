"""Admission: may this job run? One table of rules, applied at three stages.

* ``submit`` (the API, api/services/jobs/submit_checks.py): the spec, the operator's settings,
  the tenant and the fleet the workers registered.
* ``claim`` (the worker, worker/run/prepare.py): the GPUs (or SLURM pool) the run holds and
  the packages installed where the trainer will run.
* ``preflight`` (the trainer, core/train/job.py): what torch sees on the machine the run
  started on (CUDA, bf16), and the operator's switches the worker wrote into the run plan.

Each rule says which facts it needs; a stage runs every rule whose facts it has, so a rule
is enforced at the earliest stage that can know it and again at every later stage that
can (a spec.json edited by hand, an operator switch changed since the submit). Every stage
answers the same type, a list of ``Refusal`` (param, message, error code).

What stays with the caller: lookups and file reads (an upload's row, the data rows, a local
model's tokenizer files and layer classes) are checked by the API at submit
(api/services/jobs/submit_checks.py) because they need the database or the data; the worker
resolves the same paths again when it builds the run plan (worker/run/prepare.py).

Pure: spec and facts in, refusals out. No web, queue or database code (the trainer imports
this module).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Literal

from core.infra.errors import ErrorCode
from core.infra.settings import Settings
from core.policy.fleet import Inventory, fleet_refusal, runnable_on
from core.policy.hardware import (
    device_refusal,
    preference_refusal,
    quantization_refusal,
    worker_refusal,
)
from core.policy.memory import fit_refusal
from core.policy.refusal import Refusal, Refused
from core.policy.slurm import SlurmPool, slurm_pool_refusal
from core.policy.sources import model_kind, model_location, remote_code_refusal
from core.policy.tracking import tracking_refusals
from core.spec import JobSpec


class Stage(StrEnum):
    submit = "submit"
    claim = "claim"
    preflight = "preflight"


@dataclass(frozen=True)
class Fleet:
    """What the API knows at submit: the registered workers and this process's SLURM pool.
    ``queue_unrunnable``: the operator admits jobs no worker can run yet (they wait)."""

    inventories: tuple[Inventory, ...]
    pool: SlurmPool | None
    queue_unrunnable: bool = False


@dataclass(frozen=True)
class Machine:
    """What the worker holds for this run: ``gpus`` on this machine (0: a CPU slot), or a
    SLURM ``pool`` whose nodes run it. ``cpu_fsdp2``: the operator's switch on this worker."""

    gpus: int
    pool: SlurmPool | None = None
    cpu_fsdp2: bool = False


@dataclass(frozen=True)
class Installed:
    """The optional packages where the trainer runs."""

    bitsandbytes: bool
    trl: bool

    @classmethod
    def here(cls) -> Installed:
        # Read through the module, so the one definition of each probe is the one used.
        from core.policy import hardware

        return cls(bitsandbytes=hardware.bitsandbytes_installed(), trl=hardware.trl_installed())


@dataclass(frozen=True)
class Device:
    """What the trainer sees: the device the run was resolved for, and what torch says."""

    device: Literal["cpu", "cuda"]
    cuda_available: bool
    bf16_ok: bool
    cpu_fsdp2: bool = False


@dataclass(frozen=True)
class Facts:
    """What one stage knows; None: not known there. Field names are what rules ``need``."""

    settings: Settings | None = None
    tenant: str | None = None
    allow_remote_code: bool | None = None
    fleet: Fleet | None = None
    machine: Machine | None = None
    installed: Installed | None = None
    device: Device | None = None


# Which facts each stage has, in the order the stages happen.
STAGE_FACTS: dict[Stage, frozenset[str]] = {
    Stage.submit: frozenset({"settings", "tenant", "allow_remote_code", "fleet"}),
    Stage.claim: frozenset({"settings", "allow_remote_code", "machine", "installed"}),
    Stage.preflight: frozenset({"allow_remote_code", "installed", "device"}),
}


@dataclass(frozen=True)
class Rule:
    name: str
    needs: frozenset[str]
    check: Callable[[JobSpec, Facts], Iterable[Refusal | None]]

    @property
    def earliest(self) -> Stage:
        """The first stage that has every fact this rule needs."""
        return next(s for s, have in STAGE_FACTS.items() if self.needs <= have)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(s for s, have in STAGE_FACTS.items() if self.needs <= have)


def _priority(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    assert f.settings is not None and f.tenant is not None
    bound = f.settings.tenant_limit(f.tenant, "max_priority")
    if bound is not None and spec.priority > bound:
        yield Refusal(ErrorCode.invalid_spec, "priority",
                      f"{spec.priority} is above this tenant's bound {bound}")


def _graders(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    # What a grpo job's grader needs (python graders, a judge, a metric's data) against
    # what this server allows; the operator may have turned it off between submit and claim.
    from core.graders.job_checks import grpo_grader_problems

    assert f.settings is not None
    for p in grpo_grader_problems(spec, f.settings):
        yield Refusal(ErrorCode.invalid_spec, p.param, p.message)


def _remote_code(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    assert f.allow_remote_code is not None
    yield remote_code_refusal(spec.model, allowed=f.allow_remote_code)


def _tracking(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    # The operator may have narrowed the trackers between the submit and the claim.
    assert f.settings is not None
    yield from tracking_refusals(spec.tracking, f.settings)


def _fleet(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    """A spec that no registered worker (nor pool) could ever run. With no worker registered
    yet (an embedded stack starting, a fresh deployment) only a multi-machine job is refused
    (it needs a SLURM pool); otherwise the worker that claims the job refuses it if it
    cannot run it."""
    fleet = f.fleet
    assert fleet is not None
    if fleet.queue_unrunnable:
        return
    if fleet.inventories:
        yield fleet_refusal(spec, fleet.inventories)
        if fleet.pool is not None:
            yield slurm_pool_refusal(spec, fleet.pool)
    else:
        yield slurm_pool_refusal(spec, fleet.pool)


def _memory_fit(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    """A full fine-tune that fits no GPU of the registered workers that could run it
    (core/policy/memory.py). Local models only: a hub model's config is read by the worker
    that claims it, which checks the GPUs it holds (worker/run/prepare.py ``check_fit``)."""
    fleet = f.fleet
    assert fleet is not None and f.settings is not None
    m = spec.model
    if (fleet.queue_unrunnable or not fleet.inventories or spec.peft.method != "full"
            or model_kind(m.name_or_path) != "path" or m.trust_remote_code):
        return
    try:
        path = model_location(m.name_or_path, f.settings)
        memories = [inv.gpu_memory_mb for inv in runnable_on(spec, fleet.inventories)]
        yield fit_refusal(spec, path, memories)
    except (Refused, OSError, ValueError):  # the model checks at submit report these
        return


def _machine(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    m = f.machine
    assert m is not None
    if m.pool is not None:
        yield slurm_pool_refusal(spec, m.pool)
    else:
        yield worker_refusal(spec, m.gpus, cpu_fsdp2=m.cpu_fsdp2)


def _packages(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    # Before any weights are read: QLoRA without bitsandbytes fails here, by name.
    assert f.installed is not None
    yield quantization_refusal(spec, bitsandbytes_installed=f.installed.bitsandbytes)
    yield preference_refusal(spec, trl_installed=f.installed.trl)


def _device(spec: JobSpec, f: Facts) -> Iterable[Refusal | None]:
    d = f.device
    assert d is not None
    yield device_refusal(spec, d.device, cuda_available=d.cuda_available, bf16_ok=d.bf16_ok,
                         cpu_fsdp2=d.cpu_fsdp2)


RULES: tuple[Rule, ...] = (
    Rule("priority_bound", frozenset({"settings", "tenant"}), _priority),
    Rule("remote_code", frozenset({"allow_remote_code"}), _remote_code),
    Rule("tracking", frozenset({"settings"}), _tracking),
    Rule("graders", frozenset({"settings"}), _graders),
    Rule("fleet", frozenset({"fleet"}), _fleet),
    Rule("memory_fit", frozenset({"settings", "fleet"}), _memory_fit),
    Rule("machine", frozenset({"machine"}), _machine),
    Rule("packages", frozenset({"installed"}), _packages),
    Rule("device", frozenset({"device"}), _device),
)


def check(stage: Stage, spec: JobSpec, facts: Facts) -> list[Refusal]:
    """Every refusal of every rule whose facts ``stage`` has (at most one per param)."""
    given = {fd.name for fd in fields(facts) if getattr(facts, fd.name) is not None}
    missing = STAGE_FACTS[stage] - given
    assert not missing, f"stage {stage} needs facts {sorted(missing)}"
    out: list[Refusal] = []
    for rule in RULES:
        if rule.needs <= STAGE_FACTS[stage]:
            for r in rule.check(spec, facts):
                if r is not None and all(o.param != r.param for o in out):
                    out.append(r)
    return out


def submit(spec: JobSpec, *, settings: Settings, tenant: str,
           inventories: Sequence[Inventory], pool: SlurmPool | None) -> list[Refusal]:
    """What the API refuses before it records a job."""
    return check(Stage.submit, spec, Facts(
        settings=settings, tenant=tenant, allow_remote_code=settings.allow_trust_remote_code,
        fleet=Fleet(tuple(inventories), pool, queue_unrunnable=settings.queue_unrunnable)))


def claim(spec: JobSpec, *, settings: Settings, machine: Machine,
          installed: Installed | None = None) -> list[Refusal]:
    """What the worker refuses once it holds the run's hardware, before it builds anything."""
    return check(Stage.claim, spec, Facts(
        settings=settings, allow_remote_code=settings.allow_trust_remote_code,
        machine=machine, installed=installed or Installed.here()))


def preflight(spec: JobSpec, *, allow_remote_code: bool, device: Device,
              installed: Installed | None = None) -> list[Refusal]:
    """What the trainer refuses before it loads weights (a job directory can be run by hand,
    on another machine than the worker resolved it for)."""
    return check(Stage.preflight, spec, Facts(
        allow_remote_code=allow_remote_code, device=device,
        installed=installed or Installed.here()))
