"""Prepare: resolve a claimed job into what the trainer needs so it never touches the
database, applying the run policy (core/policy/) on the way: spec.json (spec + runtime),
accelerate.yaml, launch.json (argv and env, also on the job row for GET /launch).
A job the policy refuses raises Refused before any process starts."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.db.models import File, Job
from core.db.session import execute_rowcount, session_scope
from core.infra import hub
from core.infra.errors import ErrorCode
from core.infra.ports import free_port
from core.infra.settings import Settings, get_settings
from core.jobs.continuation import find_source
from core.policy import (
    Refusal,
    Refused,
    SlurmPool,
    admission,
    data_path,
    fsdp_wrap_classes,
    model_kind,
    model_location,
    node_cpus,
    resolve_tracking,
    run_deadline,
    stored_upload,
    time_limit,
)
from core.policy.memory import fit_refusal
from core.run.jobdir import JobDir, write_json_atomic
from core.run.plan import RunPlan, Runtime
from core.spec import JobSpec, SpecError
from worker.run import process_tree
from worker.run.claim import Claim, held_by

log = logging.getLogger(__name__)


def available_gpus(settings: Settings) -> int:
    from worker.upkeep.registry import gpu_list

    return len(gpu_list(settings))


def run_gpus(claim: Claim, settings: Settings) -> int:
    """GPUs this run may use: those the scheduler placed it on, none in a CPU slot, or (a
    claim with no placement, which the run is about to refuse) all of this worker's."""
    if claim.gpu_ids:
        return len(claim.gpu_ids)
    if claim.cpu_slot is not None:
        return 0
    return available_gpus(settings)


def _uploaded_file(session: Session, file_id: str, tenant_id: str, settings: Settings,
                   param: str) -> str:
    f = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id))
    if f is None:
        raise Refused(Refusal(ErrorCode.invalid_dataset, param, f"file {file_id} not found"))
    # The upload was validated (and hashed) as received; train on exactly those bytes.
    return str(stored_upload(file_id, f.storage_path, settings, param, size=f.bytes,
                             sha256=f.sha256))


def admit(spec: JobSpec, settings: Settings, machine: admission.Machine) -> None:
    """The claim stage of admission (core/policy/admission.py): refuse what the hardware
    this run holds cannot run honestly (instead of running something else), and what the
    operator no longer allows."""
    refusals = admission.claim(spec, settings=settings, machine=machine)
    if refusals:
        raise Refused(refusals[0])


def build_runtime(session: Session, claim: Claim, spec: JobSpec, settings: Settings,
                  job_dir: JobDir, device: Literal["cpu", "cuda"], *,
                  pool: SlurmPool | None = None) -> Runtime:
    d = spec.dataset
    if d.file_id is not None:
        train_path = _uploaded_file(session, d.file_id, claim.tenant_id, settings,
                                    "dataset.file_id")
    elif d.path is not None:
        train_path = str(data_path(d.path, settings, "dataset.path"))
    else:
        raise Refused(Refusal(ErrorCode.invalid_spec, "dataset", "no file_id or path"))
    eval_path = None
    if d.eval_file_id is not None:
        eval_path = _uploaded_file(session, d.eval_file_id, claim.tenant_id, settings,
                                   "dataset.eval_file_id")
    elif d.eval_path is not None:
        eval_path = str(data_path(d.eval_path, settings, "dataset.eval_path"))
    timeout = time_limit(spec, settings.default_timeout_seconds)
    resume = job_dir.latest_checkpoint() if claim.attempt > 1 else None
    # On SLURM the time limit is enforced by SLURM (--time) from the moment the job starts
    # on its nodes; a deadline counted from the claim would include its time in SLURM's queue.
    deadline = None if pool is not None else run_deadline(
        claim.started_at.timestamp(), claim.paused_seconds, timeout)
    # model.from_job: the adapter this job starts from, found again (it may be gone since);
    # for a full fine-tune, the source's model directory is what the weights load from.
    source = (
        find_source(session, claim.tenant_id, spec.model.from_job, spec.model.step)
        if spec.model.from_job
        else None
    )
    init = source.path if source is not None and not source.full else None
    model_path = (
        str(source.path)
        if source is not None and source.full
        else model_location(spec.model.name_or_path, settings)
    )
    return Runtime(
        job_id=claim.job_id,
        attempt=claim.attempt,
        model_path=model_path,
        train_path=Path(train_path),
        eval_path=Path(eval_path) if eval_path is not None else None,
        resume_from_checkpoint=resume,
        init_adapter=Path(init) if init else None,
        device=device,
        allow_trust_remote_code=settings.allow_trust_remote_code,
        cpu_fsdp2=device == "cpu" and settings.cpu_fsdp2,
        max_decompressed_bytes=settings.decompressed_limit,
        deadline=deadline,
        tracking=resolve_tracking(spec, settings, job_id=claim.job_id,
                                  tenant_id=claim.tenant_id),
        graders=grader_runtime(spec, settings),
    )


def check_fit(spec: JobSpec, runtime: Runtime, claim: Claim, settings: Settings) -> None:
    """A full fine-tune must fit the GPUs this run holds (core/policy/memory.py); the API
    checked the fleet for local models, this is where hub models are checked."""
    from worker.upkeep.registry import gpu_list

    memory = {int(g["index"]): int(g["memory_mb"]) for g in gpu_list(settings)}
    held = [memory.get(i, 0) for i in claim.gpu_ids] or list(memory.values())
    if not held or min(held) <= 0:
        return
    try:
        refusal = fit_refusal(
            spec, runtime.model_path, [min(held)],
            trust_remote_code=spec.model.trust_remote_code and runtime.allow_trust_remote_code)
    except (OSError, ValueError) as e:
        raise Refused(Refusal(ErrorCode.model_not_found, "model.name_or_path",
                              f"cannot read the model config: {e}")) from None
    if refusal is not None:
        raise Refused(refusal)


def grader_runtime(spec: JobSpec, settings: Settings) -> dict[str, Any] | None:
    """What the job's grader may do here (what the claim stage of admission checked it
    against: core/policy/admission.py)."""
    if spec.training.grpo is None:
        return None
    from core.graders.config import GraderRuntime

    return GraderRuntime.from_settings(settings).model_dump()


def layer_classes(spec: JobSpec, runtime: Runtime) -> list[str] | None:
    """The layer classes FSDP wraps (the spec's, checked against the model, or the model's
    _no_split_modules), found on the meta device, no weights read."""
    return fsdp_wrap_classes(
        spec, runtime.model_path,
        trust_remote_code=spec.model.trust_remote_code and runtime.allow_trust_remote_code)


def _trainer_argv(job_dir: Path, port: int | None) -> list[str]:
    from worker.run.accelerate_config import launch_argv

    # settings.trainer_module (FTUNE_TRAINER_MODULE) lets tests run a fake trainer through
    # the same `accelerate launch` path.
    return launch_argv(
        job_dir,
        python=sys.executable,
        main_process_port=port,
        module=get_settings().trainer_module,
    )


def _local_gpu_ids(spec: JobSpec, gpu_ids: tuple[int, ...]) -> list[int] | None:
    """accelerate's gpu_ids for a placed job: its GPUs, one per local process (a
    strategy-none job runs one process on its one GPU). None: no placement (all GPUs)."""
    if not gpu_ids:
        return None
    return list(gpu_ids)


@dataclass(frozen=True)
class Prepared:
    argv: list[str]
    env: dict[str, str]  # added to the launcher's environment
    deadline: float | None  # time.time() past which the run times out
    timeout_seconds: int | None
    cpus: list[int] | None = None  # the cores the launch is pinned to (a CPU slot's)


def slot_share(claim: Claim, settings: Settings) -> tuple[list[int], bool]:
    """The cores a CPU run may use (its slot's share of this worker's, or all of them for a
    claim without a slot) and whether to pin it to them (settings.worker_pin_cpus)."""
    from worker.upkeep.registry import slot_cpus, usable_cpus

    cpus = usable_cpus()
    if claim.cpu_slot is None:
        return cpus, False
    return (slot_cpus(cpus, max(1, claim.cpu_slots), claim.cpu_slot),
            settings.worker_pin_cpus and hasattr(os, "sched_setaffinity"))


def hub_env(name: str) -> dict[str, str]:
    """A hub id the trainer can load: from the hub, or from the cache alone (HF_HUB_OFFLINE,
    when the hub is out of reach: no minute of retries). Raises Refused when neither."""
    if model_kind(name) != "hub":
        return {}
    reach = hub.access(name)
    if reach.refusal is not None:
        raise Refused(Refusal(ErrorCode.model_not_found, "model.name_or_path", reach.refusal))
    return {"HF_HUB_OFFLINE": "1"} if reach.offline else {}


def prepare(claim: Claim, settings: Settings, jd: JobDir, *,
            pool: SlurmPool | None = None) -> Prepared:
    """Everything up to the launch. Raises Refused (the job cannot run here).

    ``pool``: the run goes to this SLURM pool (worker/slurm/): its nodes' hardware counts,
    not this machine's."""
    from worker.run.accelerate_config import (
        AccelerateConfigError,
        accelerate_config,
        launch_env,
        render_yaml,
    )

    spec = claim.spec
    if spec is None:
        msg = claim.spec_error or "stored spec is invalid"
        raise Refused(Refusal(ErrorCode.invalid_spec, "spec", msg, text=msg))
    gpus = run_gpus(claim, settings) if pool is None else pool.gpus_per_node
    admit(spec, settings, admission.Machine(gpus, pool=pool, cpu_fsdp2=settings.cpu_fsdp2))
    device: Literal["cpu", "cuda"] = "cuda" if gpus > 0 else "cpu"
    jd.root.mkdir(parents=True, exist_ok=True)
    with session_scope() as s:
        runtime = build_runtime(s, claim, spec, settings, jd, device, pool=pool)

    if pool is None and device == "cuda":
        check_fit(spec, runtime, claim, settings)
    # Whatever an earlier attempt left that would confuse this one.
    process_tree.kill_tagged(f"{claim.job_id}:")
    for stale in (jd.stop, jd.error):
        stale.unlink(missing_ok=True)
    for stale_dir in (jd.adapter_tmp, jd.adapter, jd.model_tmp, jd.model):
        shutil.rmtree(stale_dir, ignore_errors=True)

    # Where the scheduler placed the run: its GPUs (physical indices, also in
    # CUDA_VISIBLE_DEVICES and accelerate's gpu_ids) and a rendezvous port of its own, so
    # two jobs on one machine never share one.
    port = free_port()
    runtime = runtime.model_copy(update={"gpu_ids": list(claim.gpu_ids),
                                         "main_process_port": port})
    RunPlan(spec=spec, runtime=runtime).write(jd.spec)
    try:
        cfg = accelerate_config(spec, device=device, layer_cls=layer_classes(spec, runtime),
                                cpu_fsdp2=runtime.cpu_fsdp2,
                                gpu_ids=_local_gpu_ids(spec, claim.gpu_ids))
    except SpecError as e:
        raise Refused(Refusal(ErrorCode.invalid_spec, "spec", str(e), text=str(e))) from None
    except AccelerateConfigError as e:
        raise Refused(Refusal(ErrorCode.unsupported_hardware, e.param, e.message)) from None
    yaml_text = render_yaml(cfg)
    jd.accelerate_config.write_text(yaml_text)
    env = launch_env(spec, device=device)
    if settings.hub_check:
        env.update(hub_env(spec.model.name_or_path))
    cpus, pin = slot_share(claim, settings) if device == "cpu" and pool is None else ([], False)
    if claim.gpu_ids:
        # The job sees only its own GPUs; accelerate's gpu_ids (the same physical indices)
        # says the same to every rank.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in claim.gpu_ids)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # torchrun pins multi-process ranks to 1 thread, a single process gets torch's
        # default (every core): on a busy machine OpenMP's spinning threads then slow a
        # small model down 10-100x. Give each rank its share of the cores of its slot (a
        # CPU worker's cores are split evenly between its slots).
        per_machine = spec.distributed.processes_per_node
        cores = node_cpus(pool, per_machine) if pool is not None else len(cpus)
        env["OMP_NUM_THREADS"] = str(max(1, cores // per_machine))
    argv = _trainer_argv(jd.root, port)
    launch = {"argv": argv, "accelerate_yaml": yaml_text, "env": env,
              "cpus": cpus if pin else None}
    write_json_atomic(jd.launch, launch)
    with session_scope() as s:
        n = execute_rowcount(s, update(Job).where(Job.id == claim.job_id, *held_by(claim))
                             .values(job_dir=str(jd.root), launch=launch)
                             .execution_options(synchronize_session=False))
    if n != 1:
        raise RuntimeError("lost the job while preparing it")
    return Prepared(argv, env, runtime.deadline,
                    time_limit(spec, settings.default_timeout_seconds),
                    cpus=cpus if pin else None)
