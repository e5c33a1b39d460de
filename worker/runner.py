"""One run of one job on this worker: claim, prepare the job directory, launch the trainer,
watch it, finish. Every status change is a guarded transition (worker/transitions.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, literal, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from core.db.models import File, Job, JobEvent, JobStatus, UTCDateTime, utcnow
from core.db.session import execute_rowcount, session_scope
from core.errors import ErrorCode
from core.jobdir import JobDir, write_json_atomic
from core.policy import (
    Refusal,
    Refused,
    data_path,
    fsdp_wrap_classes,
    model_location,
    remote_code_refusal,
    stored_upload,
    worker_refusal,
)
from core.settings import Settings, get_settings
from core.spec import JobSpec, SpecError
from worker import launcher
from worker.monitor import ACTIVE, heartbeat, ingest_events, read_control
from worker.transitions import transition

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
LOG_TAIL_LINES = 40


def worker_identity(settings: Settings | None = None) -> str:
    settings = settings or get_settings()
    return settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"


@lru_cache(maxsize=1)
def _cuda_count() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # pragma: no cover - a broken CUDA install counts as none
        log.exception("could not count CUDA devices")
        return 0


def available_gpus(settings: Settings) -> int:
    return settings.worker_gpus if settings.worker_gpus is not None else _cuda_count()


# --------------------------------------------------------------------------------------
# Transitions.


def _now_param(now: datetime) -> Any:
    return literal(now, type_=UTCDateTime())


@dataclass(frozen=True)
class Claim:
    job_id: str
    tenant_id: str
    worker_id: str
    attempt: int
    spec: dict[str, Any]
    started_at: datetime


def claim_job(job_id: str, worker_id: str, *, max_attempts: int) -> Claim | None:
    """queued -> running for exactly one caller. None when the job is not (or no longer)
    this worker's to run: duplicate delivery, already running elsewhere, finished,
    cancelled, or out of attempts (then it is failed with worker_lost here)."""
    now = utcnow()
    with session_scope() as s:
        claimed = transition(
            s, job_id, to=JobStatus.running, previous=JobStatus.queued,
            guard=[Job.status == JobStatus.queued, Job.cancel_requested_at.is_(None),
                   Job.attempt < max_attempts],
            values={
                "worker_id": worker_id,
                "attempt": Job.attempt + 1,
                "started_at": _started_at_or(now),
                "heartbeat_at": now,
                "finished_at": None,
                "error_code": None,
                "error_message": None,
            },
            event_data={"worker_id": worker_id},
        )
        job = s.get(Job, job_id, populate_existing=True)
        if job is None:
            log.warning("job %s: no such job; message dropped", job_id)
            return None
        if claimed:
            assert job.started_at is not None
            return Claim(job.id, job.tenant_id, worker_id, job.attempt, dict(job.spec),
                         job.started_at)
        if job.status == JobStatus.queued and job.cancel_requested_at is not None:
            transition(s, job_id, to=JobStatus.cancelled, previous=JobStatus.queued,
                       guard=[Job.status == JobStatus.queued,
                              Job.cancel_requested_at.is_not(None)],
                       values={"finished_at": now, "worker_id": None})
        elif job.status == JobStatus.queued and job.attempt >= max_attempts:
            msg = f"gave up after {job.attempt} attempts (max_attempts={max_attempts})"
            transition(s, job_id, to=JobStatus.failed, previous=JobStatus.queued,
                       guard=[Job.status == JobStatus.queued, Job.attempt >= max_attempts],
                       values={"finished_at": now, "worker_id": None,
                               "error_code": ErrorCode.worker_lost, "error_message": msg},
                       event_data={"error_code": ErrorCode.worker_lost})
        else:
            log.info("job %s is %s (worker %s); not claimed", job_id, job.status, job.worker_id)
        return None


def _started_at_or(now: datetime) -> Any:
    from sqlalchemy import func

    return func.coalesce(Job.started_at, _now_param(now))


# --------------------------------------------------------------------------------------
# Runtime: what the worker resolves so the trainer never needs the database.


def _uploaded_file(session: Session, file_id: str, tenant_id: str, settings: Settings,
                   param: str) -> str:
    f = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id))
    if f is None:
        raise Refused(Refusal(ErrorCode.invalid_dataset, param, f"file {file_id} not found"))
    # The upload was validated (and hashed) as received; train on exactly those bytes.
    return str(stored_upload(file_id, f.storage_path, settings, param, size=f.bytes,
                             sha256=f.sha256))


def check_hardware(spec: JobSpec, gpus: int, *, cpu_fsdp2: bool = False) -> None:
    """Refuse what this worker cannot run honestly (instead of running something else).

    ``cpu_fsdp2``: the operator lets this worker run FSDP2 on CPU (settings.cpu_fsdp2)."""
    refusal = worker_refusal(spec, gpus, cpu_fsdp2=cpu_fsdp2)
    if refusal is not None:
        raise Refused(refusal)


def build_runtime(session: Session, claim: Claim, spec: JobSpec, settings: Settings,
                  job_dir: JobDir, device: str) -> dict[str, Any]:
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
    refusal = remote_code_refusal(spec.model, allowed=settings.allow_trust_remote_code)
    if refusal is not None:
        raise Refused(refusal)
    timeout = spec.resources.timeout_seconds or settings.default_timeout_seconds
    resume = job_dir.latest_checkpoint() if claim.attempt > 1 else None
    return {
        "job_id": claim.job_id,
        "attempt": claim.attempt,
        "model_path": model_location(spec.model.name_or_path, settings),
        "train_path": train_path,
        "eval_path": eval_path,
        "resume_from_checkpoint": str(resume) if resume else None,
        "device": device,
        "allow_trust_remote_code": settings.allow_trust_remote_code,
        "cpu_fsdp2": device == "cpu" and settings.cpu_fsdp2,
        "deadline": claim.started_at.timestamp() + timeout if timeout else None,
    }


def layer_classes(spec: JobSpec, runtime: dict[str, Any]) -> list[str] | None:
    """The layer classes FSDP wraps (the spec's, checked against the model, or the model's
    _no_split_modules), found on the meta device, no weights read."""
    return fsdp_wrap_classes(
        spec, runtime["model_path"],
        trust_remote_code=spec.model.trust_remote_code and runtime["allow_trust_remote_code"])


def _trainer_argv(job_dir: Path, port: int | None) -> list[str]:
    from worker.accelerate_config import launch_argv

    # settings.trainer_module (FTUNE_TRAINER_MODULE) lets tests run a fake trainer through
    # the same `accelerate launch` path.
    return launch_argv(
        job_dir,
        python=sys.executable,
        main_process_port=port,
        module=get_settings().trainer_module,
    )


# --------------------------------------------------------------------------------------
# Adapter check and log tail.


def adapter_problem(adapter_dir: Path) -> str | None:
    """None if the final adapter is usable; else what is wrong with it."""
    cfg = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    if not cfg.is_file():
        return "adapter_config.json is missing"
    try:
        if not isinstance(json.loads(cfg.read_text()), dict):
            return "adapter_config.json is not a JSON object"
    except (OSError, ValueError) as e:
        return f"adapter_config.json does not parse: {e}"
    if not weights.is_file():
        return "adapter_model.safetensors is missing"
    try:
        total, nonzero, bad = _scan_safetensors(weights)
    except Exception as e:  # noqa: BLE001 - any failure to read it makes it unusable
        return f"adapter_model.safetensors does not open: {e}"
    if bad is not None:
        return bad
    if total == 0:
        return ("adapter_model.safetensors holds only empty tensors (a sharded FSDP/ZeRO-3 "
                "save without gathering writes no weights)")
    if not nonzero:
        return "every adapter weight is zero"
    return None


# The dtypes safetensors can hand to numpy (safetensors.numpy), by whether they are floats.
_NUMPY_FLOATS = {"F64", "F32", "F16"}
_NUMPY_OTHERS = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "C64"}


def _scan_safetensors(path: Path) -> tuple[int, bool, str | None]:
    """(element count, any non-zero weight, problem) of a safetensors file, read with
    ``safetensors.safe_open`` (which validates the header and the data offsets).

    Tensors come out as numpy arrays, one at a time. Only a dtype numpy lacks (BF16, the
    8-bit floats) is read through torch, which is imported then and not before: importing it
    stalls this worker's loop for seconds. Floats are checked for NaN/inf and zeros; other
    dtypes (integers, bools, 8-bit floats) only for "any bit set"."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        names: list[str] = f.keys()
        slices = {k: f.get_slice(k) for k in names}
        specs = {k: (s.get_dtype(), s.get_shape()) for k, s in slices.items()}
    if not specs:
        return 0, False, "adapter_model.safetensors holds no tensors"
    numpy_only = all(d in _NUMPY_FLOATS | _NUMPY_OTHERS for d, _ in specs.values())
    total, nonzero = 0, False
    with safe_open(path, framework="numpy" if numpy_only else "pt") as f:
        for key, (dtype, shape) in specs.items():
            count = math.prod(shape)
            total += count
            if count == 0:
                continue
            is_float = dtype in _NUMPY_FLOATS or dtype == "BF16"
            values = _as_numpy(f.get_tensor(key), dtype, is_float)
            if not is_float:
                nonzero = nonzero or bool(values.any())
                continue
            if not bool(np.isfinite(values).all()):
                return total, nonzero, f"tensor {key} has NaN or infinite values"
            nonzero = nonzero or bool(np.any(values != 0))
    return total, nonzero, None


def _as_numpy(tensor: Any, dtype: str, is_float: bool) -> np.ndarray:
    """A numpy view of what safe_open returned: as it is from the numpy framework; from
    torch, BF16 widened to float32 and any other dtype as its raw bytes."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return tensor
    import torch

    if is_float:
        return tensor.to(torch.float32).numpy()
    return tensor.contiguous().view(torch.uint8).numpy()


def tail_lines(path: Path, n: int = LOG_TAIL_LINES, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


_ROOT_CAUSE = re.compile(r"^\s*rank\s*:\s*(\d+)\b.*?$\s*^\s*exitcode\s*:\s*(-?\d+)",
                         re.MULTILINE)


def elastic_root_cause(lines: list[str]) -> tuple[int, int] | None:
    """(rank, exit code) of the first rank to fail, from torch elastic's failure summary
    ("Root Cause (first observed failure)") at the end of a multi-process run's log."""
    text = "\n".join(lines)
    at = text.rfind("Root Cause (first observed failure)")
    if at < 0:
        return None
    m = _ROOT_CAUSE.search(text, at)
    return (int(m.group(1)), int(m.group(2))) if m else None


# --------------------------------------------------------------------------------------
# The run.


@dataclass
class Outcome:
    returncode: int | None = None
    stop_reason: str | None = None  # cancel | timeout | shutdown | lost
    survivors: list[int] = field(default_factory=list)


class JobRun:
    def __init__(self, claim: Claim, settings: Settings) -> None:
        self.claim = claim
        self.settings = settings
        self.job_id = claim.job_id
        self.jd = JobDir(settings.jobs_dir / claim.job_id)
        self.launched: launcher.Launched | None = None
        self.deadline: float | None = None
        self.timeout_seconds: int | None = None
        self.env_extra: dict[str, str] = {}
        self.notes: list[JobEvent] = []  # written with the final status
        self.status: str = JobStatus.running  # as this run last saw it

    # Guards every write this run makes once the job is claimed.
    def _held(self) -> list[ColumnElement[bool]]:
        return [Job.worker_id == self.claim.worker_id, Job.attempt == self.claim.attempt,
                Job.status.in_(ACTIVE)]

    def run(self) -> str:
        try:
            try:
                with self.keepalive():
                    argv = self.prepare()
            except Refused as e:
                return self.finish(JobStatus.failed, code=e.code, message=str(e))
            self.launched = launcher.spawn(
                argv, log_path=self.jd.log, tag=launcher.new_tag(self.job_id, self.claim.attempt),
                env=launcher.trainer_env(extra=self.env_extra))
            log.info("job %s attempt %d: launched pid %d", self.job_id, self.claim.attempt,
                     self.launched.pid)
            outcome = self.watch()
            with self.keepalive():
                return self.conclude(outcome)
        except Exception as e:
            log.exception("job %s: worker error", self.job_id)
            self._kill_now()
            return self.finish(JobStatus.failed, code=ErrorCode.internal,
                               message=f"worker error: {type(e).__name__}: {e}")
        except BaseException:
            # Cold shutdown, KeyboardInterrupt, SystemExit: the job is not at fault.
            self._kill_now()
            try:
                self.requeue("the worker was terminated")
            except Exception:
                log.exception("job %s: could not requeue; the reconciler will", self.job_id)
            raise

    @contextmanager
    def keepalive(self) -> Iterator[None]:
        """Heartbeats from a thread while the watch loop is not running: preparing (imports,
        dataset hashing, model configs) and concluding (killing the tree, verifying the
        adapter) may take longer than the heartbeat timeout, and the reconciler would give
        away a job whose worker is alive and well."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.settings.heartbeat_seconds):
                try:
                    with session_scope() as s:
                        if not heartbeat(s, self.job_id, worker_id=self.claim.worker_id,
                                         attempt=self.claim.attempt):
                            return  # finished, or no longer ours
                except SQLAlchemyError:
                    log.warning("job %s: heartbeat failed", self.job_id, exc_info=True)

        t = threading.Thread(target=beat, name=f"ftune-keepalive-{self.job_id}", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(timeout=30)

    # -- preparing -------------------------------------------------------------------

    def prepare(self) -> list[str]:
        from worker.accelerate_config import (
            AccelerateConfigError,
            accelerate_config,
            launch_env,
            render_yaml,
        )

        try:
            spec = JobSpec.model_validate(self.claim.spec)
        except ValueError as e:
            msg = f"stored spec is invalid: {e}"
            raise Refused(Refusal(ErrorCode.invalid_spec, "spec", msg, text=msg)) from None
        gpus = available_gpus(self.settings)
        check_hardware(spec, gpus, cpu_fsdp2=self.settings.cpu_fsdp2)
        device = "cuda" if gpus > 0 else "cpu"
        self.jd.root.mkdir(parents=True, exist_ok=True)
        with session_scope() as s:
            runtime = build_runtime(s, self.claim, spec, self.settings, self.jd, device)
        self.deadline = runtime["deadline"]
        self.timeout_seconds = (spec.resources.timeout_seconds
                                or self.settings.default_timeout_seconds)

        # Whatever an earlier attempt left that would confuse this one.
        launcher.kill_tagged(f"{self.job_id}:")
        for stale in (self.jd.stop, self.jd.error):
            stale.unlink(missing_ok=True)
        for stale_dir in (self.jd.adapter_tmp, self.jd.adapter):
            shutil.rmtree(stale_dir, ignore_errors=True)

        write_json_atomic(self.jd.spec, {"spec": self.claim.spec, "runtime": runtime})
        try:
            cfg = accelerate_config(spec, device=device, layer_cls=layer_classes(spec, runtime),
                                    cpu_fsdp2=runtime["cpu_fsdp2"])
        except SpecError as e:
            raise Refused(Refusal(ErrorCode.invalid_spec, "spec", str(e), text=str(e))) from None
        except AccelerateConfigError as e:
            raise Refused(Refusal(ErrorCode.unsupported_hardware, e.param, e.message)) from None
        yaml_text = render_yaml(cfg)
        self.jd.accelerate_config.write_text(yaml_text)
        self.env_extra = launch_env(spec, device=device)
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # torchrun pins multi-process ranks to 1 thread, a single process gets torch's
            # default (every core): on a busy machine OpenMP's spinning threads then slow a
            # small model down 10-100x. Give each rank its share of the cores instead.
            per_machine = max(1, spec.distributed.num_processes // spec.distributed.num_machines)
            self.env_extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_machine))
        # A rendezvous port per job, so two jobs on one machine never share one.
        argv = _trainer_argv(self.jd.root, launcher.free_port())
        launch = {"argv": argv, "accelerate_yaml": yaml_text, "env": self.env_extra}
        write_json_atomic(self.jd.launch, launch)
        with session_scope() as s:
            n = execute_rowcount(s, update(Job).where(Job.id == self.job_id, *self._held())
                                 .values(job_dir=str(self.jd.root), launch=launch)
                                 .execution_options(synchronize_session=False))
        if n != 1:
            raise RuntimeError("lost the job while preparing it")
        return argv

    # -- watching --------------------------------------------------------------------

    def _tick(self, *, do_heartbeat: bool) -> tuple[bool, bool, str | None]:
        """Ingest events, maybe heartbeat, read the control flags: (held, cancel, status)."""
        with session_scope() as s:
            while ingest_events(s, self.job_id, self.jd.root, worker_id=self.claim.worker_id,
                                attempt=self.claim.attempt):
                s.commit()
        with session_scope() as s:
            if do_heartbeat and not heartbeat(s, self.job_id, worker_id=self.claim.worker_id,
                                              attempt=self.claim.attempt):
                return False, False, None
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        return ctl.held, ctl.cancel_requested, ctl.status

    def watch(self) -> Outcome:
        from worker.celery_app import shutdown_requested

        assert self.launched is not None
        hb_every = self.settings.heartbeat_seconds
        last_hb = last_ok = time.monotonic()
        while True:
            if self.launched.poll() is not None:
                return Outcome(returncode=self.launched.popen.returncode)
            self.launched.track()
            now = time.monotonic()
            reason: str | None = None
            try:
                due = now - last_hb >= hb_every
                held, cancel, status = self._tick(do_heartbeat=due)
                last_ok = now
                if due:
                    last_hb = now
                if not held:
                    reason = "lost"
                elif cancel:
                    reason = "cancel"
                    if status == JobStatus.running:
                        with session_scope() as s:
                            transition(s, self.job_id, to=JobStatus.cancelling,
                                       previous=JobStatus.running,
                                       guard=[*self._held(), Job.status == JobStatus.running])
                    self.status = JobStatus.cancelling
            except SQLAlchemyError:
                log.warning("job %s: database unavailable", self.job_id, exc_info=True)
                if now - last_ok > self.settings.heartbeat_timeout_seconds:
                    reason = "lost"  # the reconciler has given the job away by now
            if reason is None and self.deadline is not None and time.time() >= self.deadline:
                reason = "timeout"
            if reason is None and shutdown_requested():
                reason = "shutdown"
            if reason is not None:
                return self.stop(reason)
            time.sleep(POLL_SECONDS)

    def stop(self, reason: str) -> Outcome:
        """Graceful stop (STOP file + SIGTERM), keep heart-beating and ingesting while the
        trainer saves, SIGKILL whatever is left after the grace period, verify."""
        assert self.launched is not None
        log.info("job %s: stopping trainer (%s)", self.job_id, reason)
        grace = 0.0 if reason == "lost" else self.settings.cancel_grace_seconds
        procs = launcher.request_stop(self.launched, stop_file=self.jd.stop)
        end = time.monotonic() + grace
        last_hb = time.monotonic()
        while procs and time.monotonic() < end:
            procs = launcher.wait_gone(self.launched, procs, min(1.0, end - time.monotonic()))
            if reason != "lost" and time.monotonic() - last_hb >= self.settings.heartbeat_seconds:
                try:
                    self._tick(do_heartbeat=True)
                except SQLAlchemyError:
                    log.warning("job %s: database unavailable while stopping", self.job_id)
                last_hb = time.monotonic()
        survivors = launcher.kill_remaining(self.launched, procs)
        self.launched.poll()
        return Outcome(returncode=self.launched.popen.returncode, stop_reason=reason,
                       survivors=sorted(p.pid for p in survivors))

    def _kill_now(self) -> None:
        if self.launched is None:
            return
        try:
            launcher.stop_tree(self.launched, grace=0)
        except Exception:
            log.exception("job %s: killing the trainer failed", self.job_id)

    # -- finishing -------------------------------------------------------------------

    def conclude(self, outcome: Outcome) -> str:
        assert self.launched is not None
        # Whatever the launcher left behind (it exited, a rank or loader may not have).
        leftovers = launcher.kill_remaining(self.launched)
        survivors = sorted({*outcome.survivors, *(p.pid for p in leftovers)})
        if survivors:
            self.notes.append(JobEvent(
                job_id=self.job_id, type="log", message=f"processes survived SIGKILL: {survivors}",
                data={"level": "error", "pids": survivors}))
        if outcome.stop_reason == "lost":
            log.warning("job %s: this worker no longer holds attempt %d; trainer stopped",
                        self.job_id, self.claim.attempt)
            return "lost"
        try:
            self._tick(do_heartbeat=False)  # the last events, before the final status
        except SQLAlchemyError:
            log.warning("job %s: could not ingest the last events", self.job_id, exc_info=True)

        if outcome.stop_reason == "shutdown":
            return self.requeue("the worker shut down")
        if outcome.stop_reason == "cancel":
            return self.finish(JobStatus.cancelled)
        if outcome.stop_reason == "timeout":
            return self.finish(JobStatus.failed, code=ErrorCode.timeout,
                               message=self._timeout_message())

        rc = outcome.returncode
        problem = adapter_problem(self.jd.adapter) if self.jd.adapter.is_dir() else None
        if rc == 0 and self.jd.adapter.is_dir() and problem is None:
            return self.finish(JobStatus.succeeded, adapter_path=str(self.jd.adapter))
        with session_scope() as s:
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        if ctl.cancel_requested:
            return self.finish(JobStatus.cancelled)
        if self.deadline is not None and time.time() >= self.deadline:
            return self.finish(JobStatus.failed, code=ErrorCode.timeout,
                               message=self._timeout_message())
        if rc == 0 and problem is not None:
            return self.finish(JobStatus.failed, code=ErrorCode.adapter_invalid,
                               message=f"the trainer's adapter is unusable: {problem}")
        if rc == 0:
            return self.finish(JobStatus.failed, code=ErrorCode.trainer_crashed,
                               message="trainer exited 0 without an adapter", with_log=True)
        err = self.jd.read_error() or {}
        code = err.get("code")
        if code not in {c.value for c in ErrorCode}:
            code = ErrorCode.trainer_crashed
        message = str(err.get("message") or f"trainer exited with code {rc}")
        cause = elastic_root_cause(tail_lines(self.jd.log, n=200))
        if cause is not None and not err:
            message = f"rank {cause[0]} failed first (exit code {cause[1]}): {message}"
        elif cause is not None and cause[0] != err.get("rank"):
            # error.json came from a rank that failed *because* another one died first (a
            # collective whose peer vanished): name the one that failed first.
            message = (f"rank {cause[0]} failed first (exit code {cause[1]}; see the log); "
                       f"then rank {err.get('rank')}: {message}")
        return self.finish(JobStatus.failed, code=ErrorCode(code), message=message,
                           with_log=True, has_error_file=bool(err),
                           traceback=err.get("traceback"))

    def _timeout_message(self) -> str:
        return f"the job ran past its time limit of {self.timeout_seconds} s"

    def finish(self, status: str, *, code: ErrorCode | None = None, message: str | None = None,
               adapter_path: str | None = None, with_log: bool = False,
               has_error_file: bool = True, traceback: str | None = None) -> str:
        events, self.notes = list(self.notes), []
        if with_log:
            lines = tail_lines(self.jd.log)
            if lines and not has_error_file:
                # No classified error: the log tail is all the user gets, so put it in view.
                message = f"{message}\n--- last {len(lines)} lines of trainer.log ---\n" + \
                    "\n".join(lines)
            events.append(JobEvent(job_id=self.job_id, type="log",
                                   message=f"last {len(lines)} lines of trainer.log",
                                   data={"level": "error", "lines": lines,
                                         "traceback": traceback}))
        now = utcnow()
        with session_scope() as s:
            ok = transition(
                s, self.job_id, to=status, previous=self.status, guard=self._held(),
                values={"finished_at": now, "heartbeat_at": now, "error_code": code,
                        "error_message": message, "adapter_path": adapter_path},
                event_data={"error_code": code, "attempt": self.claim.attempt},
            )
            if ok:
                s.add_all(events)
        if not ok:
            log.warning("job %s: not finished as %s; this worker no longer holds it",
                        self.job_id, status)
            return "lost"
        log.info("job %s: %s%s", self.job_id, status, f" ({code})" if code else "")
        return str(status)

    def requeue(self, why: str) -> str:
        """Give the job back to the queue (the attempt stays counted) and enqueue it again:
        its message was acked long ago. A cancel that was requested wins."""
        with session_scope() as s:
            ctl = read_control(s, self.job_id, worker_id=self.claim.worker_id,
                               attempt=self.claim.attempt)
        if ctl.cancel_requested:
            return self.finish(JobStatus.cancelled)
        with session_scope() as s:
            ok = transition(
                s, self.job_id, to=JobStatus.queued, previous=self.status, guard=self._held(),
                values={"worker_id": None, "heartbeat_at": None, "queued_at": utcnow()},
                event_data={"reason": why, "attempt": self.claim.attempt})
            if ok:
                s.add(JobEvent(job_id=self.job_id, type="requeued", message=why,
                               data={"attempt": self.claim.attempt}))
        if not ok:
            return "lost"
        log.info("job %s: back to queued (%s)", self.job_id, why)
        try:
            from worker.dispatch import enqueue_job

            enqueue_job(self.job_id)
        except Exception:
            log.exception("job %s: re-enqueue failed; the reconciler will retry", self.job_id)
        return str(JobStatus.queued)


def run_job(job_id: str) -> str:
    """Run one delivery of ``job_id``; returns the final status, or "skipped"/"lost"."""
    settings = get_settings()
    worker_id = worker_identity(settings)
    claim = claim_job(job_id, worker_id, max_attempts=settings.max_attempts)
    if claim is None:
        return "skipped"
    log.info("job %s: claimed attempt %d as %s", job_id, claim.attempt, worker_id)
    return JobRun(claim, settings).run()
